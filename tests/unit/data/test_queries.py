"""The shipped assistant-style corpus: size, splits, provenance, no duplicates."""

from __future__ import annotations

import pytest

from surge.data import calibration_queries, heldout_queries, load_queries, query_sources


def test_size_and_disjoint_splits():
    cal, held = calibration_queries(), heldout_queries()
    assert len(cal) >= 500 and len(held) >= 2000  # enough for a meaningful 2% top-1 budget
    assert len(cal) + len(held) == len(load_queries())
    assert not set(map(str.lower, cal)) & set(map(str.lower, held))


def test_deduplicated_and_bounded():
    texts = load_queries()
    keys = [t.lower().rstrip("?.! ") for t in texts]
    assert len(keys) == len(set(keys))
    assert all(3 <= len(t) <= 400 and t == t.strip() and "\n" not in t for t in texts)
    lengths = sorted(len(t) for t in texts)
    assert lengths[-1] > 150 > lengths[len(lengths) // 2]  # mixed lengths: a long tail beside short queries


def test_every_row_names_its_source():
    rows = query_sources()
    assert all(r["source"].split(":")[0].endswith(".whl") and r["split"] in ("calibration", "heldout") for r in rows)
    packages = {r["source"].split("-")[0] for r in rows}
    assert {"chatterbot_corpus", "ovos_skill_weather", "ovos_skill_date_time"} <= packages
    assert not any("{" in r["text"] for r in rows)  # every slot was filled


def test_bad_split_is_refused():
    with pytest.raises(ValueError):
        load_queries("train")

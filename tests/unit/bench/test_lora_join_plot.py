"""benchmarks/lora_join_plot.py reads gpu_lora_join.py's JSON (a recorded run) and draws the modules' costs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import lora_join_plot  # noqa: E402

RUN = ROOT / "docs/benchmarks/s34/call4/lora_join.json"


def test_a_recorded_run_is_totalled_and_plotted(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    record = json.loads(RUN.read_text())
    totals = lora_join_plot.step_totals(record, 24)
    # the recording script's own totals (it printed and stored them): the same sums
    for slots, t in totals.items():
        own = record[f"totals_{slots}"]
        assert t["base"] == pytest.approx(own["base"]) and t["two kernels"] == pytest.approx(own["two kernels"])
        assert t["engine's choice"] == pytest.approx(own["joined"])
    # a module past the join limit (4 slots' qkv) counts its two kernels in the engine's choice
    four = [r for r in record["rows"] if r["slots"] == 4]
    assert any(r["joined"] is None for r in four)
    assert totals[4]["engine's choice"] > sum(r["joined"] or 0.0 for r in four) * 24
    png = tmp_path / "j.png"
    assert lora_join_plot.main([str(png), str(RUN)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    chosen = totals[2]["engine's choice"]
    assert f"| 2 | {totals[2]['base']:.0f} | {chosen:.0f} (+{chosen - totals[2]['base']:.0f})" in out

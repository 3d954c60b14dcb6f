"""benchmarks/speculation_plot.py reads generate.py's printed tables (a recorded run) and draws the ratio."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import speculation_plot  # noqa: E402

RUN = ROOT / "docs/benchmarks/s33/call2/generate.txt"


def test_a_recorded_run_is_read_and_plotted(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    r = speculation_plot.read(RUN)
    assert (r["streams"], r["k"], r["spec_steps"]) == (64, 3, 570)
    # the medians of the run's own table rows
    rows = [line for line in RUN.read_text().splitlines() if line.startswith("| surge")]
    assert f"/ {r['plain']:.0f} |" in rows[0] and f"/ {r['spec']:.0f} |" in rows[1]
    other = tmp_path / "no_spec.txt"  # a run without the speculation row is left out
    other.write_text("\n".join(line for line in RUN.read_text().splitlines() if "speculation" not in line))
    assert speculation_plot.read(other) is None
    png = tmp_path / "s.png"
    assert speculation_plot.main([str(png), "--uncapped", str(RUN), str(other)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert f"{r['spec'] / r['plain']:.2f}x" in out and out.count("| every step may speculate |") == 1

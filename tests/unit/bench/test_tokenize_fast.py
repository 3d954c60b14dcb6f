"""benchmarks/tokenize_fast.py prints one row per gap, both paths timed on the bundled model."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import tokenize_fast as B  # noqa: E402


def test_one_row_per_gap_with_both_paths_and_their_ratio(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tokenize_fast.py", "--calls", "6", "--gaps-ms", "0,0.5"])
    B.main()
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ") and " ms |" in r]
    assert [r.split("|")[1].strip() for r in rows] == ["0 ms", "0.5 ms"]
    for r in rows:
        plain, fast, ratio = (c.strip() for c in r.split("|")[2:5])
        assert float(plain) > 0 and float(fast) > 0
        want = float(plain) / float(fast)  # from the printed (rounded) medians: within their rounding
        assert abs(float(ratio.rstrip("x")) - want) <= 0.05 + (want + 1) * 0.05 / float(fast)

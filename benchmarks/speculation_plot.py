"""Speculative decoding's speed-up against the number of streams, from benchmarks/generate.py outputs.

    python3 benchmarks/speculation_plot.py docs/benchmarks/s33/speculation.png \\
        --uncapped docs/benchmarks/s33/call2/generate.txt docs/benchmarks/s33/call3/generate_s*_k3.txt \\
        --capped docs/benchmarks/s33/call4/generate_s*.txt

Each file is the printed output of one `generate.py ... --speculative-tokens K` run (its table has a
`surge` row and a `surge, n-gram speculation` row of the same run). Plotted: the speculation row's median
tok/s over the plain row's, against the streams, one series for runs where every step could speculate
(`speculative_max_batch` at or above the streams: --uncapped) and one for the default cap (--capped);
printed: the same as a table.
"""

from __future__ import annotations

import re
from pathlib import Path

_HEAD = re.compile(r"^\S+ \(\w+, \w+\): (\d+) streams")
_ROW = re.compile(r"^\| (surge(?:, n-gram speculation \(k=(\d+)\))?) \| [\d.]+ / ([\d.]+) \|")
_STEPS = re.compile(r"n-gram speculation \(k=\d+\): (\d+) speculative steps")


def read(path: Path) -> dict | None:
    """{streams, k, plain, spec, spec_steps} of one run's output (medians), None without both rows."""
    out: dict = {}
    for line in path.read_text().splitlines():
        if m := _HEAD.match(line):
            out["streams"] = int(m.group(1))
        elif m := _ROW.match(line):
            if m.group(2):
                out["k"], out["spec"] = int(m.group(2)), float(m.group(3))
            else:
                out["plain"] = float(m.group(3))
        elif m := _STEPS.search(line):
            out["spec_steps"] = int(m.group(1))
    return out if {"streams", "plain", "spec"} <= out.keys() else None


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("png", type=Path)
    ap.add_argument("--uncapped", nargs="+", type=Path, default=[], help="runs with speculative_max_batch >= streams")
    ap.add_argument("--capped", nargs="+", type=Path, default=[], help="runs with the default speculative_max_batch")
    args = ap.parse_args(argv)
    series = {"every step may speculate": [r for r in map(read, args.uncapped) if r],
              "default cap (speculative_max_batch 2)": [r for r in map(read, args.capped) if r]}
    print("| runs | streams | k | plain tok/s | speculation tok/s | ratio | speculative steps |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, runs in series.items():
        for r in sorted(runs, key=lambda r: (r["streams"], r["k"])):
            print(f"| {label} | {r['streams']} | {r['k']} | {r['plain']:,.0f} | {r['spec']:,.0f} | "
                  f"{r['spec'] / r['plain']:.2f}x | {r.get('spec_steps', '-')} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (label, runs), style in zip(series.items(), ("o-", "s--")):
        pts = sorted((r["streams"], r["spec"] / r["plain"]) for r in runs if r["k"] == 3)
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tok/s with / without speculation")
    ax.set_title("n-gram speculation (k = 3), Qwen2-0.5B shape, H100")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What a decode step's LoRA deltas cost each module's GEMM, from benchmarks/gpu_lora_join.py's JSON, as bars.

    python3 benchmarks/lora_join_plot.py docs/benchmarks/s34/lora_join.png docs/benchmarks/s34/call4/lora_join.json

One panel per slot count: for each module (qkv, o, up_gate, down) the base kernel's us a call, with the deltas
joined into it (where the module's stacked rank fits), and with the two delta kernels after it. Printed: each
panel's step total (modules x layers) of the engine's choice (joined, else two kernels) over the base kernels'.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SERIES = ("base", "joined", "two kernels")


def step_totals(record: dict, layers: int) -> dict[int, dict[str, float]]:
    """slots -> {base, engine's choice, two kernels}: us a step over the modules' rows x layers."""
    out: dict[int, dict[str, float]] = {}
    for row in record["rows"]:
        t = out.setdefault(row["slots"], {"base": 0.0, "engine's choice": 0.0, "two kernels": 0.0})
        t["base"] += row["base"] * layers
        t["engine's choice"] += (row["joined"] if row["joined"] is not None else row["two kernels"]) * layers
        t["two kernels"] += row["two kernels"] * layers
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("png", type=Path)
    ap.add_argument("record", type=Path)
    ap.add_argument("--layers", type=int, default=24, help="the shape's layers (Qwen2-0.5B: 24)")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(args.record.read_text())
    slots = sorted({r["slots"] for r in record["rows"]})
    fig, axes = plt.subplots(1, len(slots), figsize=(5.5 * len(slots), 4), squeeze=False)
    for ax, s in zip(axes[0], slots):
        rows = [r for r in record["rows"] if r["slots"] == s]
        for j, name in enumerate(SERIES):
            xs = [i + (j - 1) * 0.27 for i in range(len(rows))]
            ys = [r[name] if r[name] is not None else 0.0 for r in rows]
            ax.bar(xs, ys, width=0.27, label=name if name != "joined" else "joined (none: past 128 columns)")
        ax.set_xticks(range(len(rows)), [f"{r['module']}\n{r['columns']} columns" for r in rows])
        ax.set_ylabel("us a call (24 layers' weights, one CUDA graph)")
        ax.set_title(f"{record['shape']}, {s} slots of rank {record['rank']}, M = 64")
        ax.legend(fontsize=8)
    fig.suptitle(f"LoRA deltas in the decode GEMMs ({record['gpu']})")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print("| slots | base kernels, us a step | engine's choice | two delta kernels |\n| ---: | ---: | ---: | ---: |")
    for s, t in step_totals(record, args.layers).items():
        base, chosen, two = t["base"], t["engine's choice"], t["two kernels"]
        print(f"| {s} | {base:.0f} | {chosen:.0f} (+{chosen - base:.0f}) | {two:.0f} (+{two - base:.0f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

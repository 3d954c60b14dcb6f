"""Plot benchmarks/gpu_encoder.py's JSON: model-only latency per workload and system (log scale).

    python3 benchmarks/gpu_plot.py docs/benchmarks/gpu_raw/gpu_encoder.json docs/benchmarks/gpu_encoder.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def main(src: str, dst: str) -> None:
    rows = json.load(open(src))["rows"]
    systems = [("hf_eager_fp32_ms", "HF eager FP32"), ("hf_sdpa_fp16_ms", "HF SDPA FP16"),
               ("hf_sdpa_fp16_graph_ms", "HF FP16 + CUDA graph"), ("surge_ms", "surge"), ("floor_ms", "floor")]
    x = np.arange(len(rows))
    w = 0.16
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (key, label) in enumerate(systems):
        ax.bar(x + (i - 2) * w, [r[key] for r in rows], w, label=label)
    ax.set_xticks(x, [r["workload"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("ms per batch (median, CUDA events)")
    ax.set_title("BERT-base on one H200: model-only time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Issue 21, session 12: would a per-channel shift (Outlier Suppression+, Wei et al. 2023) do the outlier split's job?

The INT8 artifact keeps each weighted node's 4 largest input channels out of the per-row int8 product and
computes them in FP32 (a Gather and a K=4 Gemm over the whole [T, N] output: ~14% of the INT8 run at
32-query batches, docs/benchmarks/optimizer.md, session 11). If an outlier channel were mostly a constant
offset, subtracting a per-channel centre before quantizing (folded exactly into the LayerNorm's beta and the
node's bias, at no run-time cost) would shrink it instead. This reads the real activations entering every
weighted node of the bundled MiniLM on 600 calibration queries (transformers, FP32, real tokens only) and
prints, per node: its largest channels' max |x|, mean and standard deviation, and the median over tokens of a
row's max |x| (what the per-row scale follows) as it is, after the shift by (max + min) / 2, and with the 4
channels split off.

    PYTHONPATH=src python benchmarks/int8_outlier_shift.py
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from surge.data import calibration_queries
from surge.models import bundled_model_dir


def main() -> None:
    md = str(bundled_model_dir())
    tok, model = AutoTokenizer.from_pretrained(md), AutoModel.from_pretrained(md).eval()
    acts: dict[str, list] = {}
    mask_now: list = []

    def hook(name):
        def f(mod, inp, out):
            acts.setdefault(name, []).append(inp[0].detach().reshape(-1, inp[0].shape[-1])[mask_now[0]])
        return f

    for i, layer in enumerate(model.encoder.layer):
        layer.attention.self.query.register_forward_hook(hook(f"L{i} qkv"))
        layer.attention.output.dense.register_forward_hook(hook(f"L{i} attn-out"))
        layer.intermediate.dense.register_forward_hook(hook(f"L{i} ffn-in"))
        layer.output.dense.register_forward_hook(hook(f"L{i} ffn-out"))
    qs = calibration_queries()[:600]
    with torch.no_grad():
        for b in range(0, len(qs), 50):
            enc = tok(qs[b:b + 50], return_tensors="pt", padding=True)
            mask_now[:] = [enc["attention_mask"].reshape(-1).bool()]
            model(**enc)
    print("| node | top channels | their max abs | mean | std | row max: as is | shifted | 4 split off |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: |")
    for name, parts in acts.items():
        x = torch.cat(parts).numpy().astype(np.float64)
        amax = np.abs(x).max(0)
        top = np.argsort(-amax)[:3]
        shifted = x - (x.min(0) + x.max(0)) / 2
        keep = np.ones(x.shape[1], bool)
        keep[np.argsort(-amax)[:4]] = False
        med = lambda v: float(np.median(np.abs(v).max(1)))  # noqa: E731
        print(f"| {name} | {list(map(int, top))} | {amax[top].round(1).tolist()} | {x.mean(0)[top].round(1).tolist()} | "
              f"{x.std(0)[top].round(1).tolist()} | {med(x):.2f} | {med(shifted):.2f} | {med(x[:, keep]):.2f} |")


if __name__ == "__main__":
    main()

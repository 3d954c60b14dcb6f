"""The decode step's GEMMs alone at M = 64 (Qwen2-0.5B shapes, BF16): cuBLAS against cuBLASLt, the
residual added in the GEMM (addmm_, beta = 1) against F.linear, and the split-K kernel with the plan
the engine uses for the shape (engines/kernels/splitk_gemm.PLANS; --splitk-plans: a tuning run's
table instead): its partial sums alone (what the decode step launches; the reader sums them) and with
the ordered reduce kernel. 24 layers' distinct weights per shape (as the model reads them, so L2 holds
none of them between uses), captured in one CUDA graph; median of 7 timings of 20 replays each. Per
GEMM microseconds.

    PYTHONPATH=src python3 benchmarks/gpu_decode_gemms.py [--splitk-plans tune.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "up_gate": (9728, 896), "down": (896, 4864), "lm_head": (151936, 896)}


def layer_dims(shape: str) -> dict:
    """A benchmarks/generate.py model shape's decode-step dimensions: hidden h, intermediate i, query / kv
    heads nq / nkv of size d, the fused qkv width, layers and vocabulary (the engine's weight shapes:
    qkv [qkv, h], o [h, h], up_gate [2i, h], down [h, i])."""
    from generate import SHAPES as MODELS

    cfg = MODELS[shape][1]
    h, nq, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // nq
    return {"h": h, "i": cfg["intermediate_size"], "nq": nq, "nkv": nkv, "d": d, "qkv": (nq + 2 * nkv) * d,
            "layers": cfg["num_hidden_layers"], "vocab": cfg["vocab_size"]}


def timed(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    out = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(reps):
            g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--splitk-plans", type=Path)
    args = ap.parse_args()
    from surge.engines.kernels import splitk_gemm as sk

    if args.splitk_plans:
        from benchmarks.generate import use_splitk_plans

        use_splitk_plans(args.splitk_plans)
    torch.manual_seed(0)
    dev = "cuda"
    m = 64
    print("| GEMM (M = 64) | N x K | MB of weights | cuBLAS us | cuBLASLt us | addmm_ residual (cuBLAS) us | "
          "split-K partials us | split-K + reduce kernel us | split-K plan | floor at 4 TB/s us |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for name, (n, k) in SHAPES.items():
        layers = 1 if name == "lm_head" else 24
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        res = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        row = []
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            row.append(timed(lambda: [F.linear(x, w) for w in ws]) / layers)
        torch.backends.cuda.preferred_blas_library("cublas")
        row.append(timed(lambda: [res.addmm_(x, w.t()) for w in ws]) / layers)
        plan = sk.plan_for(n, k)
        if plan is not None:
            part = timed(lambda: [sk.partials(x, w, plan) for w in ws]) / layers
            red = timed(lambda: [sk.reduce_partials(sk.partials(x, w, plan)) for w in ws]) / layers
            sk_cols = f"{part:.2f} | {red:.2f} | {plan.block_n}, {plan.block_k}, {plan.num_splits(k)} splits"
        else:
            sk_cols = "- | - | none (cuBLAS)"
        mb = n * k * 2 / 1e6
        print(f"| {name} | {n} x {k} | {mb:.1f} | {row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} | {sk_cols} | "
              f"{mb / 4e6 * 1e6:.2f} |", flush=True)
    # the step's tail: FP32 cast + argmax against argmax on BF16 logits
    logits = torch.randn(m, 151936, device=dev, dtype=torch.bfloat16)
    t32 = timed(lambda: logits.float().argmax(-1))
    t16 = timed(lambda: logits.argmax(-1))
    try:
        from surge.engines.kernels.decoder_fused import argmax_rows
    except Exception as exc:
        print("argmax_rows:", exc)
        return
    tt = timed(lambda: argmax_rows(logits))
    print(f"\nlogits [64, 151936]: FP32 cast + argmax {t32:.2f} us, argmax on BF16 {t16:.2f} us, "
          f"Triton two-pass argmax {tt:.2f} us")
    for trial in range(20):  # the same index as torch, ties included
        x = torch.randn(m, 151936, device=dev).to(torch.bfloat16) if trial % 2 else \
            torch.randint(-3, 4, (m, 151936), device=dev).to(torch.bfloat16)  # many ties
        assert torch.equal(argmax_rows(x), x.argmax(-1)), trial
    print("argmax_rows equals torch.argmax on 20 draws (half of them with ties everywhere)")


if __name__ == "__main__":
    main()

"""Tune the split-K GEMM (engines/kernels/splitk_gemm.py) for the decode step's GEMMs against cuBLAS.

Per layer GEMM of a benchmarks/generate.py shape (--shape: Qwen2-0.5B by default, Llama-1B since
session 20) at M = 64 (BF16): every candidate plan (BLOCK_N, BLOCK_K, split count, num_warps,
num_stages, swapped operands; with --tma each also with its operands read by TMA) is checked against a
float64 product, then timed as the model's layers' distinct weights in one CUDA graph (L2 holds none of them between uses; median of 7 timings
of 20 replays). The best plans are then timed as the decode step runs them: the GEMM followed by the
fused kernel that reads its output (qkv -> rope_and_cache, o and down -> add_rmsnorm, up_gate ->
silu_mul), against F.linear followed by the same kernel on BF16; and at M = 1 / 16 / 32. The plan
of a shape is kept where the pair beats cuBLAS's pair.

    PYTHONPATH=src python3 benchmarks/gpu_splitk_tune.py [--shape llama-1b] [--tma] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode_gemms import layer_dims, timed  # noqa: E402  (one CUDA-graph timer for both scripts)

SPLITS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 19, 24, 28, 38)


def gemm_shapes(dims: dict) -> dict:
    """The layer's GEMMs as (N, K) of their [N, K] weights."""
    h, i = dims["h"], dims["i"]
    return {"qkv": (dims["qkv"], h), "o": (h, h), "up_gate": (2 * i, h), "down": (h, i)}


def cdiv(a, b):
    return -(-a // b)


def candidates(n, k, quick=False, tma=False):
    """(block_n, block_k, splits, num_warps, num_stages, swap[, tma]) tuples: 48-700 programs, distinct K
    cuts; with tma each plan twice, pointer loads and TMA (the 7th field)."""
    out = []
    for swap in (False, True):
        for bn in (16, 32, 64, 128):
            for bk in (64, 128, 256):
                if bk > k:
                    continue
                seen = set()
                for s in SPLITS:
                    ks = cdiv(cdiv(k, s), bk) * bk
                    if ks in seen:
                        continue
                    seen.add(ks)
                    ctas = cdiv(n, bn) * cdiv(k, ks)
                    if not 48 <= ctas <= 700:
                        continue
                    iters = ks // bk
                    stages = (1,) if iters == 1 else (2,) if iters == 2 else (3,)
                    for st in stages:
                        out.append((bn, bk, s, 4, st, swap))
    if quick:
        out = out[::4]
    if tma:
        out += [(*p, True) for p in out]
    return out


def _compile(job):
    """Worker: compile (and run once) a list of plans, so the parent finds them in Triton's disk cache."""
    from surge.engines.kernels.splitk_gemm import SplitKPlan, partials

    n, k, plans = job
    a = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bad = []
    for p in plans:
        try:
            partials(a, w, SplitKPlan(*p))
            torch.cuda.synchronize()
        except Exception as exc:  # e.g. out of shared memory: dropped by the parent too
            bad.append((p, f"{type(exc).__name__}: {str(exc)[:120]}"))
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--shape", default="qwen2-0.5b", help="a benchmarks/generate.py shape")
    ap.add_argument("--tma", action="store_true", help="also every plan with its operands read by TMA")
    args = ap.parse_args()
    dims = layer_dims(args.shape)
    SHAPES, LAYERS = gemm_shapes(dims), dims["layers"]
    from surge.engines.kernels import splitk_gemm as sk
    from surge.engines.kernels.decoder_fused import add_rmsnorm, rope_and_cache, silu_mul

    dev = "cuda"
    torch.manual_seed(0)
    cands = {name: candidates(n, k, args.quick, args.tma) for name, (n, k) in SHAPES.items()}
    print({k: len(v) for k, v in cands.items()}, flush=True)
    t0 = time.perf_counter()
    jobs = []
    for name, (n, k) in SHAPES.items():
        c = cands[name]
        step = cdiv(len(c), args.workers)
        jobs += [(n, k, c[i:i + step]) for i in range(0, len(c), step)]
    bad = set()
    try:
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as ex:
            for res in ex.map(_compile, jobs):
                for p, why in res:
                    bad.add(tuple(p))
                    print("  dropped", p, why, flush=True)
    except Exception as exc:  # compile in this process instead (slower)
        print(f"parallel compile failed ({type(exc).__name__}: {exc}); compiling serially", flush=True)
    print(f"compiled in {time.perf_counter() - t0:.0f} s", flush=True)

    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
              "shapes": {}}
    m = 64
    summary = []
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = (x.double() @ ws[0].double().T)
        t_cublas = timed(lambda: [F.linear(x, w) for w in ws]) / LAYERS
        rows = []
        for p in cands[name]:
            if p in bad:
                continue
            plan = sk.SplitKPlan(*p)
            try:
                part = sk.partials(x, ws[0], plan)
                err = ((part.double().sum(0) - ref).norm() / ref.norm()).item()
                if not err < 1e-5:
                    print(f"  WRONG {name} {p}: rel err {err:.2e}", flush=True)
                    continue
                t = timed(lambda: [sk.partials(x, w, plan) for w in ws]) / LAYERS
            except Exception as exc:
                print(f"  failed {name} {p}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            rows.append((t, p))
        rows.sort()
        print(f"{name} ({n} x {k}): cuBLAS {t_cublas:.2f} us; best split-K partials: " +
              ", ".join(f"{t:.2f} {p}" for t, p in rows[:5]), flush=True)
        # phase 2: warps and stages around the three best
        extra = []
        for _, (bn, bk, s, nw, st, sw, *tm) in rows[:3]:
            for v in ((bn, bk, s, 8, st, sw, *tm), (bn, bk, s, 2, st, sw, *tm), (bn, bk, s, nw, st + 1, sw, *tm)):
                if v not in dict((q, 0) for _, q in rows) and v not in extra:
                    extra.append(v)
        for p in extra:
            plan = sk.SplitKPlan(*p)
            try:
                part = sk.partials(x, ws[0], plan)
                err = ((part.double().sum(0) - ref).norm() / ref.norm()).item()
                if not err < 1e-5:
                    continue
                rows.append((timed(lambda: [sk.partials(x, w, plan) for w in ws]) / LAYERS, p))
            except Exception as exc:
                print(f"  failed {name} {p}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        rows.sort()

        # the pair as the step runs it: GEMM + the kernel that reads its output
        res = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        norm_w = torch.randn(n, device=dev, dtype=torch.bfloat16)
        bias = torch.randn(n, device=dev, dtype=torch.bfloat16) * 0.1
        if name == "qkv":
            nq, nkv, d = dims["nq"], dims["nkv"], dims["d"]
            cache_k = torch.zeros(4096, 16, nkv, d, device=dev, dtype=torch.bfloat16)
            cache_v = torch.zeros_like(cache_k)
            pos_tab = torch.randn(4096, d, device=dev, dtype=torch.bfloat16)
            positions = torch.randint(0, 4096, (m,), device=dev)
            slots = torch.randperm(4096 * 16, device=dev)[:m]

            def consume(y, has_parts):
                rope_and_cache(y, pos_tab, pos_tab, positions, slots, cache_k, cache_v, nq, nkv, d,
                               bias=bias if has_parts else None)

            def cublas_gemm(w):
                return F.linear(x, w, bias)
        elif name == "up_gate":
            def consume(y, has_parts):
                silu_mul(y, torch.bfloat16)

            def cublas_gemm(w):
                return F.linear(x, w)
        else:
            def consume(y, has_parts):
                add_rmsnorm(res, y, norm_w, 1e-6)

            def cublas_gemm(w):
                return F.linear(x, w)

        pair_cublas = timed(lambda: [consume(cublas_gemm(w), False) for w in ws]) / LAYERS
        # the reader's cost grows with the split count: time the pair for the 6 fastest GEMMs and for
        # the fastest of each split count
        pick, per_split = [p for _, p in rows[:6]], {}
        for t, p in rows:
            per_split.setdefault(sk.SplitKPlan(*p).num_splits(k), p)
        pick += [p for p in per_split.values() if p not in pick]
        top = []
        for p in pick[:14]:
            t = dict((q, x) for x, q in rows)[p]
            plan = sk.SplitKPlan(*p)
            pair = timed(lambda: [consume(sk.partials(x, w, plan), True) for w in ws]) / LAYERS
            with_reduce = timed(lambda: [sk.reduce_partials(sk.partials(x, w, plan)) for w in ws]) / LAYERS
            top.append({"plan": p, "partials_us": t, "pair_us": pair, "gemm_reduce_us": with_reduce,
                        "splits_run": plan.num_splits(k), "programs": cdiv(n, p[0]) * plan.num_splits(k)})
        top.sort(key=lambda r: r["pair_us"])
        best = top[0]
        plan = sk.SplitKPlan(*best["plan"])
        by_m = {}
        for mm in (1, 16, 32):
            xm = x[:mm].contiguous()
            by_m[mm] = (timed(lambda: [F.linear(xm, w) for w in ws]) / LAYERS,
                        timed(lambda: [sk.partials(xm, w, plan) for w in ws]) / LAYERS)
        mb = n * k * 2 / 1e6
        summary.append((name, n, k, mb, t_cublas, best, pair_cublas, by_m))
        record["shapes"][name] = {"n": n, "k": k, "cublas_us": t_cublas, "pair_cublas_us": pair_cublas,
                                  "top": top, "all": [(t, p) for t, p in rows], "by_m": by_m}
        print(f"  pair (GEMM + reader): cuBLAS {pair_cublas:.2f} us; split-K " +
              ", ".join(f"{r['pair_us']:.2f} {r['plan']}" for r in top), flush=True)

    print(f"\n{args.shape}:\n| GEMM (M = 64) | N x K | MB | floor at 4 TB/s us | cuBLAS us | split-K partials us | "
          "split-K + reduce kernel us | cuBLAS + reader us | split-K + fused reader us | plan (BN, BK, splits, warps, "
          "stages, swap[, tma]) | programs | M = 1 / 16 / 32: cuBLAS vs split-K us |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    plans = {}
    for name, n, k, mb, tc, best, pc, by_m in summary:
        bm = " / ".join(f"{a:.2f} vs {b:.2f}" for a, b in by_m.values())
        print(f"| {name} | {n} x {k} | {mb:.1f} | {mb / 4e6 * 1e6:.2f} | {tc:.2f} | {best['partials_us']:.2f} | "
              f"{best['gemm_reduce_us']:.2f} | {pc:.2f} | {best['pair_us']:.2f} | {best['plan']} | "
              f"{best['programs']} | {bm} |")
        if best["pair_us"] < 0.98 * pc - 0.1:
            plans[(n, k)] = best["plan"]
    print("\nPLANS (pair faster than cuBLAS's by > 2% and 0.1 us):")
    for (n, k), p in plans.items():
        bn, bk, s, nw, st, sw, *tm = p
        print(f"    ({n}, {k}): SplitKPlan({bn}, {bk}, {s}, num_warps={nw}, num_stages={st}, swap={sw}"
              f"{', tma=True' if tm and tm[0] else ''}),")
    record["plans"] = {f"{n}x{k}": p for (n, k), p in plans.items()}
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

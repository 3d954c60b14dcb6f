"""Plans for the decode GEMMs on 8-bit weights (models/weight_quant.py), against the BF16 plans in the same run.

Per layer GEMM of a benchmarks/generate.py shape at M = 64: the engine's BF16 kernel and plan on BF16 weights
(the baseline: what `quantization=none` runs), then every candidate plan on the 8-bit (--kind fp8 / int8) weights
of the same shape
(the split-K partials for qkv, o and down; the one-kernel SiLU(gate) * up for up_gate), each checked against
the float64 product of the dequantized weight and timed as the model's layers' distinct weights in one CUDA graph
(L2 holds none of them between uses; median of 7 timings of 20 replays, gpu_decode_gemms.timed). Prints a table
(BF16 us, 8-bit us with the BF16 plan, best 8-bit us, ratio, the plan) and the Q8_PLANS entries to paste.

    PYTHONPATH=src python3 benchmarks/gpu_q8_tune.py [--kind int8] [--shape llama-1b] [--quick] [--json out.json]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode_gemms import layer_dims, timed  # noqa: E402

M = 64
SPLITS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 19, 24)


def cdiv(a, b):
    return -(-a // b)


def splitk_candidates(n: int, k: int, quick: bool) -> list[tuple]:
    """(block_n, block_k, splits, warps, stages, swap, tma): 48-600 programs, distinct K cuts; BLOCK_K up to
    512 (an FP8 row of 512 is the bytes of a BF16 row of 256)."""
    out = []
    for tma in (False, True):
        for swap in (False, True):
            for bn in (32, 64, 128):
                for bk in (128, 256, 512):
                    if bk > k:
                        continue
                    seen = set()
                    for s in SPLITS:
                        ks = cdiv(cdiv(k, s), bk) * bk
                        if ks in seen or not 48 <= cdiv(n, bn) * cdiv(k, ks) <= 600:
                            continue
                        seen.add(ks)
                        iters = ks // bk
                        out.append((bn, bk, s, 4, min(4, max(1, iters)), swap, tma))
    return out[::2] if quick else out


def gate_up_candidates(quick: bool) -> list[tuple]:
    """(block_n, block_k, warps, stages, swap, tma)."""
    out = [(bn, bk, 4, st, sw, tma) for tma in (False, True) for sw in (False, True) for bn in (16, 32, 64)
           for bk in (128, 256, 512) for st in (2, 3, 4)]
    return out[::2] if quick else out


def _run(kind, x, q, s, p, **kw):
    from surge.engines.kernels.gate_up import GateUpPlan, gate_up_silu
    from surge.engines.kernels.splitk_gemm import SplitKPlan, partials

    if kind == "splitk":
        return partials(x, q, SplitKPlan(*p), scale=s, **kw)
    return gate_up_silu(x, q, GateUpPlan(*p), scale=s, **kw)


def _compile(job):
    """Worker: compile (and run once) plans on 8-bit weights, so the parent finds them in Triton's disk cache."""
    from surge.models.weight_quant import quantize

    kind, n, k, plans, q8 = job
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    q, s = quantize(torch.randn(n, k, device="cuda"), q8)
    bad = []
    for p in plans:
        try:
            _run(kind, x, q, s, p)
            _run(kind, x, q, s, p, pdl=True)
            torch.cuda.synchronize()
        except Exception as exc:  # e.g. out of shared memory
            bad.append((p, f"{type(exc).__name__}: {str(exc)[:120]}"))
    return bad


SWEEP = (128, 192, 256, 512)


def _rows_sweep(kind, n, k, plan, wb, w8, layers) -> dict:
    """us a layer at each M of SWEEP: (the 8-bit kernel with `plan`, dequantize + F.linear, BF16 F.linear)."""
    import torch.nn.functional as F

    from surge.engines.kernels.decoder_fused import silu_mul
    from surge.engines.kernels.splitk_gemm import reduce_partials
    from surge.models.weight_quant import dequantize

    out = {}
    for m in SWEEP:
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)

        def tail(y):  # gate/up's SiLU product on the unfused paths, as the engine runs them
            return silu_mul(y, torch.bfloat16) if kind == "gate_up" else y

        def product(q, s):  # the kernel's output as a product: split-K's partials summed (its reduce kernel)
            out = _run(kind, x, q, s, plan)
            return reduce_partials(out) if kind == "splitk" else out

        kernel = timed(lambda: [product(q, s) for q, s in w8]) / layers
        deq = timed(lambda: [tail(F.linear(x, dequantize(q, s, torch.bfloat16))) for q, s in w8]) / layers
        bf16 = timed(lambda: [tail(F.linear(x, w)) for w in wb]) / layers
        out[m] = (kernel, deq, bf16)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2-0.5b", help="a benchmarks/generate.py shape")
    ap.add_argument("--kind", choices=["fp8", "int8"], default="fp8", help="the 8-bit weights' format")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from surge.engines.kernels import gate_up as gu
    from surge.engines.kernels import splitk_gemm as sk
    from surge.models.weight_quant import quantize

    dims = layer_dims(args.shape)
    h, i, layers = dims["h"], dims["i"], dims["layers"]
    gemms = {"qkv": ("splitk", dims["qkv"], h), "o": ("splitk", h, h), "up_gate": ("gate_up", 2 * i, h),
             "down": ("splitk", h, i)}
    cands = {name: splitk_candidates(n, k, args.quick) if kind == "splitk" else gate_up_candidates(args.quick)
             for name, (kind, n, k) in gemms.items()}
    print({name: len(c) for name, c in cands.items()}, flush=True)
    t0 = time.perf_counter()
    jobs = []
    for name, (kind, n, k) in gemms.items():
        c = cands[name]
        step = cdiv(len(c), max(1, args.workers // len(gemms)))
        jobs += [(kind, n, k, c[j:j + step], args.kind) for j in range(0, len(c), step)]
    bad = set()
    with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as ex:
        for res in ex.map(_compile, jobs):
            bad.update(tuple(p) for p, _ in res)
    print(f"compiled in {time.perf_counter() - t0:.0f} s ({len(bad)} plans dropped)", flush=True)

    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
              "kind": args.kind, "gemms": {}}
    table, by_m = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (kind, n, k) in gemms.items():
        wb = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(layers)]
        w8 = [quantize(w, args.kind) for w in wb]
        x = torch.randn(M, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = x.double() @ (w8[0][0].double() * w8[0][1].double()[:, None]).T
        if kind == "splitk":
            bplan = sk.plan_for(n, k) or sk.default_plan(n, k)
            bf16_us = timed(lambda: [sk.partials(x, w, bplan) for w in wb]) / layers
            q8_default = sk.q8_plan_for(n, k)
            as_tuple = (q8_default.block_n, q8_default.block_k, q8_default.splits, q8_default.num_warps,
                        q8_default.num_stages, q8_default.swap, q8_default.tma)
        else:
            bplan = gu.plan_for(n // 2, k) or gu.default_plan(n // 2, k)
            bf16_us = timed(lambda: [gu.gate_up_silu(x, w, bplan) for w in wb]) / layers
            q8_default = gu.q8_plan_for(n // 2, k)
            as_tuple = (q8_default.block_n, q8_default.block_k, q8_default.num_warps, q8_default.num_stages,
                        q8_default.swap, q8_default.tma)
        rows = []
        for p in [as_tuple] + [c for c in cands[name] if c != as_tuple]:
            if p in bad:
                continue
            try:
                out = _run(kind, x, *w8[0], p)
                if kind == "splitk":
                    err = ((out.double().sum(0) - ref).norm() / ref.norm()).item()
                    ok = err < 1e-5
                else:
                    gate, up = ref[:, :n // 2], ref[:, n // 2:]
                    want = gate * torch.sigmoid(gate) * up
                    err = ((out.double() - want).norm() / want.norm()).item()
                    ok = err < 1e-2
                if not ok:
                    print(f"  WRONG {name} {p}: rel err {err:.2e}", flush=True)
                    continue
                rows.append((timed(lambda: [_run(kind, x, q, s, p) for q, s in w8]) / layers, p))
            except Exception as exc:
                print(f"  failed {name} {p}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
        default_us = rows[0][0] if rows and rows[0][1] == as_tuple else float("nan")
        rows.sort()
        best_us, best = rows[0]
        print(f"{name} ({n} x {k}): BF16 {bf16_us:.2f} us; {args.kind} with its current plan {default_us:.2f}; "
              f"best {args.kind}: " + ", ".join(f"{t:.2f} {p}" for t, p in rows[:5]), flush=True)
        table.append((name, n, k, bf16_us, default_us, best_us, best))
        record["gemms"][name] = {"n": n, "k": k, "bf16_us": bf16_us, "bf16_plan": str(bplan),
                                 "q8_current_us": default_us, "q8": [(t, p) for t, p in rows[:40]]}
        by_m[name] = _rows_sweep(kind, n, k, best, wb, w8, layers)
        record["gemms"][name]["by_m"] = by_m[name]
    print(f"\n{args.shape}, M = {M}, {layers} layers' distinct weights a graph (us a layer):")
    print("| GEMM | N x K | BF16 MB | BF16 (engine plan) | 8-bit, current plan | 8-bit, best | best / BF16 | "
          "best 8-bit plan |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, n, k, b, d, t, p in table:
        print(f"| {name} | {n} x {k} | {n * k * 2 / 1e6:.1f} | {b:.2f} | {d:.2f} | {t:.2f} | {t / b:.2f}x | {p} |")
    total_b = sum(r[3] for r in table)
    total_f = sum(r[5] for r in table)
    print(f"| all four | | | {total_b:.2f} | | {total_f:.2f} | {total_f / total_b:.2f}x | |")
    print(f"\nAbove {M} rows (prefill chunks, speculative steps): the 8-bit kernel with the best plan (M tiles of 64 "
          "rows, the weight re-read from L2; split-K with its reduce) against the weight dequantized for the call + "
          "cuBLAS, and BF16 cuBLAS "
          "(us a layer; the engine runs the kernel up to splitk_gemm.MAX_M rows):")
    print("| GEMM | " + " | ".join(f"M = {m}: kernel / dequant+cuBLAS / BF16" for m in SWEEP) + " |")
    print("| --- |" + " --- |" * len(SWEEP))
    for name, row in by_m.items():
        print(f"| {name} | " + " | ".join(f"{a:.1f} / {b:.1f} / {c:.1f}" for a, b, c in row.values()) + " |")
    print("\nQ8_PLANS:")
    for name, n, k, *_, p in table:
        if gemms[name][0] == "splitk":
            print(f"    ({n}, {k}): SplitKPlan({p[0]}, {p[1]}, {p[2]}, num_warps={p[3]}, num_stages={p[4]}, "
                  f"swap={p[5]}, tma={p[6]}),")
        else:
            print(f"    gate_up ({n // 2}, {k}): GateUpPlan({p[0]}, {p[1]}, num_warps={p[2]}, num_stages={p[3]}, "
                  f"swap={p[4]}, tma={p[5]}),")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

"""The decode step's layer GEMMs with their weights read by TMA (Triton tensor descriptors), measured
against the pointer-load kernels the engine runs (issue 18, session 18).

Why: session 15 measured TMA copies streaming weights at 4.0-4.1 TB/s from a ring of a few tiles an SM,
twice the ~2 TB/s of the engine's Triton kernels (pointer loads, cp.async pipelining); its persistent
kernel lost that to grid barriers. Here the same TMA loads go into the engine's own kernel shapes,
one launch a GEMM, no barriers: kernels/gate_up.py's SiLU(gate) * up and kernels/splitk_gemm.py's
split-K partials with `tma=True` plans, both operands read through tensor descriptors (out-of-bounds
rows and columns zero-filled by the copy engine, so no masks). Session 18's calls 1-2 ran copies of
these kernels kept in this script (commit 5a62e7c; call 2 also tried Triton's warp-specialized loops,
which raised illegal memory accesses); the engine's own kernels are what it times now.

For each GEMM of Qwen2-0.5B at M = 64 (BF16): every candidate plan is checked against the pointer-load
plan of POINTER_PLANS (max abs difference of the outputs, and whether they are equal bit for bit), then timed as 24
layers' distinct weights in one CUDA graph (median of 7 x 20 replays); the MLP half of a layer
(add_rmsnorm -> gate/up -> split-K down -> add_rmsnorm) is timed with the engine's kernels and with the
best TMA ones, with and without PDL. Prints tables; --json writes everything.

    PYTHONPATH=src python3 benchmarks/gpu_tma_gemm.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode_gemms import timed  # noqa: E402

H, I, QKV, LAYERS, M = 896, 4864, 1152, 24, 64


def gate_up_tma(x, w, p, pdl=False):
    """The engine's gate/up kernel with plan tuple p = (BN, BK, warps, stages, swap) and TMA loads."""
    from surge.engines.kernels.gate_up import GateUpPlan, gate_up_silu

    return gate_up_silu(x, w, GateUpPlan(*p, tma=True), pdl=pdl)


def partials_tma(a, w, p, pdl=False):
    """The engine's split-K partials with plan tuple p = (BN, BK, splits, warps, stages, swap) and TMA loads."""
    from surge.engines.kernels.splitk_gemm import SplitKPlan, partials

    return partials(a, w, SplitKPlan(*p, tma=True), pdl=pdl)


SPLITS = {"down": (4, 7), "qkv": (7, 4), "o": (4, 2)}  # the engine's count first (its readers' measured pairs)
SHAPES = {"down": (H, I), "qkv": (QKV, H), "o": (H, H)}


def gate_up_candidates(quick=False):
    out = [(bn, bk, nw, st, sw) for sw in (False, True) for bn in (16, 32, 64, 128)
           for bk in (64, 128) for nw in (4, 8) for st in (2, 3, 4, 6)]
    return out[::4] if quick else out


def splitk_candidates(name, quick=False):
    out = [(bn, bk, s, 4, st, sw) for sw in (False, True) for bn in (32, 64, 128) for bk in (64, 128, 256)
           for s in SPLITS[name] for st in (2, 3, 4, 6) if bn * bk * st <= 64 * 256 * 3]
    return out[::5] if quick else out


def _compile(jobs):
    """Compile (and so cache on disk) each job's kernel in a worker process; the refused ones come back."""
    bad = []
    for name, p in jobs:
        try:
            if name == "gate_up":
                gate_up_tma(torch.randn(M, H, device="cuda", dtype=torch.bfloat16),
                            torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16), p)
            else:
                n, k = SHAPES[name]
                partials_tma(torch.randn(M, k, device="cuda", dtype=torch.bfloat16),
                             torch.randn(n, k, device="cuda", dtype=torch.bfloat16), p)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported by the main process
            bad.append((name, p, f"{type(exc).__name__}: {str(exc)[:160]}"))
    return bad


def precompile(quick, workers):
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    jobs = [("gate_up", p) for p in gate_up_candidates(quick)]
    jobs += [(name, p) for name in SHAPES for p in splitk_candidates(name, quick)]
    step = -(-len(jobs) // workers)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as ex:
        for bad in ex.map(_compile, [jobs[i:i + step] for i in range(0, len(jobs), step)]):
            for name, p, why in bad:
                print(f"  refused {name} {p}: {why}", flush=True)
    print(f"{len(jobs)} kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=12)
    args = ap.parse_args()
    if args.workers > 1:
        precompile(args.quick, args.workers)
    from surge.engines.kernels import pdl as pdl_mod
    from surge.engines.kernels.decoder_fused import add_rmsnorm
    from surge.engines.kernels.gate_up import POINTER_PLANS as GU_POINTER
    from surge.engines.kernels.gate_up import gate_up_silu
    from surge.engines.kernels.splitk_gemm import POINTER_PLANS as SK_POINTER
    from surge.engines.kernels.splitk_gemm import partials

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(M, H, device=dev, dtype=bf)
    xi = torch.randn(M, I, device=dev, dtype=bf)
    w_gu = [torch.randn(2 * I, H, device=dev, dtype=bf) * 0.03 for _ in range(LAYERS)]
    w_dn = [torch.randn(H, I, device=dev, dtype=bf) * 0.02 for _ in range(LAYERS)]
    w_qkv = [torch.randn(QKV, H, device=dev, dtype=bf) * 0.03 for _ in range(LAYERS)]
    w_o = [torch.randn(H, H, device=dev, dtype=bf) * 0.03 for _ in range(LAYERS)]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "gemms": {}}

    # ---- gate/up ---------------------------------------------------------------------------
    gu = GU_POINTER[(I, H)]
    ref = gate_up_silu(x, w_gu[0], gu)
    t_ref = timed(lambda: [gate_up_silu(x, w, gu) for w in w_gu]) / LAYERS
    rows = []
    cands = gate_up_candidates(args.quick)
    for p in cands:
        try:
            out = gate_up_tma(x, w_gu[0], p)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a plan the compiler refuses is reported and skipped
            rows.append({"plan": p, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        diff = (out.float() - ref.float()).abs().max().item()
        t = timed(lambda p=p: [gate_up_tma(x, w, p) for w in w_gu]) / LAYERS
        rows.append({"plan": p, "us": t, "max_abs_diff": diff, "bit_equal": bool(torch.equal(out, ref))})
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    print(f"gate/up [{2 * I} x {H}], M = {M}, 24 layers' weights, us a layer: pointer-load plan {gu} {t_ref:.2f}; "
          f"TMA best 8 of {len(ok)} ({sum('error' in r for r in rows)} refused):", flush=True)
    for r in ok[:8]:
        print(f"  {r['us']:.2f}  {r['plan']}  max|diff| {r['max_abs_diff']:.3g}  bit-equal {r['bit_equal']}")
    report["gemms"]["gate_up"] = {"engine_plan": str(gu), "engine_us": t_ref, "tma": rows}
    best_gu = ok[0]["plan"] if ok else None
    top_gu = [r["plan"] for r in ok[:3]]

    # ---- split-K GEMMs -------------------------------------------------------------------------
    best_sk = {}
    for name, ws, a in (("down", w_dn, xi), ("qkv", w_qkv, x), ("o", w_o, x)):
        n, k = SHAPES[name]
        plan = SK_POINTER[(n, k)]
        ref = partials(a, ws[0], plan)
        t_ref = timed(lambda: [partials(a, w, plan) for w in ws]) / LAYERS
        rows = []
        for p in splitk_candidates(name, args.quick):
            try:
                out = partials_tma(a, ws[0], p)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                rows.append({"plan": p, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                continue
            full = out.sum(0)
            diff = (full - ref.sum(0)).abs().max().item()
            same_shape = out.shape == ref.shape
            t = timed(lambda p=p: [partials_tma(a, w, p) for w in ws]) / LAYERS
            rows.append({"plan": p, "us": t, "max_abs_diff_of_sums": diff,
                         "bit_equal": bool(same_shape and torch.equal(out, ref)), "splits_run": out.shape[0]})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        print(f"\n{name} [{n} x {k}] partials, us a layer: pointer-load plan {plan} {t_ref:.2f}; "
              f"TMA best 8 of {len(ok)}:", flush=True)
        for r in ok[:8]:
            print(f"  {r['us']:.2f}  {r['plan']} ({r['splits_run']} splits)  max|diff| of sums "
                  f"{r['max_abs_diff_of_sums']:.3g}  bit-equal {r['bit_equal']}")
        report["gemms"][name] = {"engine_plan": str(plan), "engine_us": t_ref, "tma": rows}
        # the reader sums `plan.num_splits` partials: only plans with the engine's split count drop in
        # the pair with its reader decides (more splits, more for the reader to sum): the best of each count
        best_sk[name] = [next(r["plan"] for r in ok if r["plan"][2] == c) for c in SPLITS[name]
                         if any(r["plan"][2] == c for r in ok)]

    # ---- the MLP half of a layer, as the step chains it -------------------------------------------
    pdl_ok = pdl_mod.supported()
    norms = [1 + torch.rand(H, device=dev, dtype=bf) for _ in range(LAYERS)]
    resid = torch.randn(M, H, device=dev, dtype=bf)
    dn = SK_POINTER[(H, I)]

    # Tensors made inside the captured graph keep their addresses on every replay, so the descriptors
    # made for them while capturing stay valid.
    def chain(gu_plan, down_plan, pdl):
        def run():
            h = add_rmsnorm(resid, None, norms[0], 1e-6, pdl=pdl)
            for li in range(LAYERS):
                if down_plan is not None:
                    part = partials_tma(gate_up_tma(h, w_gu[li], gu_plan, pdl=pdl), w_dn[li], down_plan, pdl=pdl)
                else:
                    part = partials(gate_up_silu(h, w_gu[li], gu, pdl=pdl), w_dn[li], dn, pdl=pdl)
                h = add_rmsnorm(resid, part, norms[li], 1e-6, pdl=pdl)
        return run

    report["chain"] = []
    if best_gu is not None:
        print("\nthe MLP half of a layer (add_rmsnorm -> gate/up -> split-K down -> add_rmsnorm), us a layer:")
        variants = [(None, None)] + [(g, d) for g in top_gu for d in best_sk["down"]]
        for (gu_plan, down_plan), pdl in itertools.product(variants, (False, True) if pdl_ok else (False,)):
            t = timed(chain(gu_plan, down_plan, pdl)) / LAYERS
            report["chain"].append({"gate_up": gu_plan, "down": down_plan, "pdl": pdl, "us": t})
            what = "pointer-load plans" if down_plan is None else f"TMA gate/up {gu_plan}, down {down_plan}"
            print(f"  {t:.2f}  {what}, pdl={pdl}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

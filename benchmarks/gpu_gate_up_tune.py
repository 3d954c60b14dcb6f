"""Tune the one-kernel SiLU(gate) * up (engines/kernels/gate_up.py) against cuBLAS + silu_mul (issue 18).

Qwen2-0.5B's MLP input at M = 64 (BF16; I = 4864, K = 896). Every candidate plan (BLOCK_N, BLOCK_K,
num_warps, num_stages, swapped operands) is checked against a float64 reference (SiLU(g) * u of the
BF16-rounded products), then timed alone as 24 layers' distinct weights in one CUDA graph (median of 7
timings of 20 replays). The fastest are then timed as the decode step runs them, the MLP half of a
layer: add_rmsnorm -> [gate_up_silu | F.linear + silu_mul] -> split-K down -> add_rmsnorm, with and
without programmatic dependent launch. Prints tables; --json writes everything.

    PYTHONPATH=src python3 benchmarks/gpu_gate_up_tune.py [--json out.json] [--quick]
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

from gpu_decode_gemms import timed  # noqa: E402

I, K, H, LAYERS, M = 4864, 896, 896, 24, 64


def candidates(quick=False):
    out = [(bn, bk, nw, st, sw) for sw in (False, True) for bn in (16, 32, 64) for bk in (64, 128, 256)
           for nw in (4, 8) for st in (2, 3, 4)]
    return out[::3] if quick else out


def _compile(plans):
    from surge.engines.kernels.gate_up import GateUpPlan, gate_up_silu

    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * I, K, device="cuda", dtype=torch.bfloat16)
    bad = []
    for p in plans:
        for pdl in (False, True):
            try:
                gate_up_silu(x, w, GateUpPlan(*p), pdl=pdl)
                torch.cuda.synchronize()
            except Exception as exc:
                bad.append((p, f"{type(exc).__name__}: {str(exc)[:120]}"))
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args()
    from surge.engines.kernels import pdl as pdl_mod
    from surge.engines.kernels.decoder_fused import add_rmsnorm, silu_mul
    from surge.engines.kernels.gate_up import GateUpPlan, gate_up_silu
    from surge.engines.kernels.splitk_gemm import partials, plan_for

    cands = candidates(args.quick)
    t0 = time.perf_counter()
    bad = set()
    step = -(-len(cands) // args.workers)
    try:
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as ex:
            for res in ex.map(_compile, [cands[i:i + step] for i in range(0, len(cands), step)]):
                for p, why in res:
                    bad.add(tuple(p))
                    print("  dropped", p, why, flush=True)
    except Exception as exc:
        print(f"parallel compile failed ({type(exc).__name__}: {exc}); compiling serially", flush=True)
    print(f"{len(cands)} candidates compiled in {time.perf_counter() - t0:.0f} s", flush=True)

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    ws = [torch.randn(2 * I, K, device=dev, dtype=bf) * 0.03 for _ in range(LAYERS)]
    wd = [torch.randn(H, I, device=dev, dtype=bf) * 0.02 for _ in range(LAYERS)]
    norms = [1 + torch.rand(H, device=dev, dtype=bf) for _ in range(LAYERS)]
    x = torch.randn(M, K, device=dev, dtype=bf)
    g64 = (x.double() @ ws[0][:I].double().T).to(bf).double()
    u64 = (x.double() @ ws[0][I:].double().T).to(bf).double()
    ref = g64 * torch.sigmoid(g64) * u64
    pair = silu_mul(F.linear(x, ws[0]), bf)
    pair_err = ((pair.double() - ref).norm() / ref.norm()).item()

    t_pair = timed(lambda: [silu_mul(F.linear(x, w), bf) for w in ws]) / LAYERS
    t_cublas = timed(lambda: [F.linear(x, w) for w in ws]) / LAYERS
    rows = []
    for p in cands:
        if p in bad:
            continue
        plan = GateUpPlan(*p)
        out = gate_up_silu(x, ws[0], plan)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        if not err < max(2 * pair_err, 1e-3):
            print(f"  WRONG {p}: rel err {err:.2e} (cuBLAS pair {pair_err:.2e})", flush=True)
            continue
        rows.append((timed(lambda: [gate_up_silu(x, w, plan) for w in ws]) / LAYERS, p, err))
    rows.sort()
    print(f"\nalone, us a layer (M = {M}): cuBLAS GEMM {t_cublas:.2f}, cuBLAS + silu_mul {t_pair:.2f} "
          f"(rel err {pair_err:.1e}); one kernel, best 8:")
    for t, p, err in rows[:8]:
        print(f"  {t:.2f} us  plan {p}  rel err {err:.1e}")

    # the MLP half of a layer, as the decode step chains it
    pdl_ok = pdl_mod.supported()
    down = plan_for(H, I)
    resid = torch.randn(M, H, device=dev, dtype=bf)

    def layer_chain(mlp_in, pdl):
        def run():
            h = add_rmsnorm(resid, None, norms[0], 1e-6, pdl=pdl)
            for li in range(LAYERS):
                m = mlp_in(h, ws[li], pdl)
                h = add_rmsnorm(resid, partials(m, wd[li], down, pdl=pdl), norms[li], 1e-6, pdl=pdl)
        return run

    chain = []
    base = {}
    for pdl in ([False, True] if pdl_ok else [False]):
        base[pdl] = timed(layer_chain(lambda h, w, pdl: silu_mul(F.linear(h, w), bf, pdl=pdl), pdl)) / LAYERS
    for t, p, _ in rows[:8]:
        plan = GateUpPlan(*p)
        for pdl in ([False, True] if pdl_ok else [False]):
            tc = timed(layer_chain(lambda h, w, pdl, plan=plan: gate_up_silu(h, w, plan, pdl=pdl), pdl)) / LAYERS
            chain.append((tc, p, pdl))
    chain.sort()
    print("\nthe MLP half of a layer (add_rmsnorm -> MLP input -> split-K down -> add_rmsnorm), us a layer:")
    for pdl, t in base.items():
        print(f"  cuBLAS + silu_mul, pdl={pdl}: {t:.2f}")
    for tc, p, pdl in chain[:10]:
        print(f"  one kernel {p}, pdl={pdl}: {tc:.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "m": M, "i": I, "k": K,
            "cublas_us": t_cublas, "cublas_silu_us": t_pair, "pair_rel_err": pair_err,
            "alone": [{"us": t, "plan": p, "rel_err": e} for t, p, e in rows],
            "chain_base_us": {str(k): v for k, v in base.items()},
            "chain": [{"us": t, "plan": p, "pdl": d} for t, p, d in chain]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

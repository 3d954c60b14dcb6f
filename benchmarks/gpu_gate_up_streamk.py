"""The decode step's gate/up with its work dealt over every SM (kernels/gate_up_streamk.py) against the
engine's one-tile-a-program kernel (kernels/gate_up.py, its measured TMA plan), issue 18, session 25.

Why: the engine's plan gives Qwen2-0.5B's gate/up 76 programs (4864 / 64-wide tiles) for the H200's 132
SMs; session 24's ablation put gate/up at 8.4 us a layer in the step's chain for 4.4 us of weights. The
stream-K kernel cuts the (tile, K step) units into one even run a program.

For each shape at M = 64 (BF16), 24 layers' distinct weights in one CUDA graph (median of 7 x 20 replays,
benchmarks/gpu_decode_gemms.timed): the kernels alone, with and without PDL, stream-K at several grid
sizes and K steps; then the MLP half of a layer as the step chains it (add_rmsnorm -> gate/up -> the
engine's split-K down -> add_rmsnorm) with each. Outputs checked against the engine kernel first.

    PYTHONPATH=src python3 benchmarks/gpu_gate_up_streamk.py [--shape qwen2-0.5b|llama-1b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode_gemms import timed  # noqa: E402

SHAPES = {"qwen2-0.5b": (896, 4864, 24), "llama-1b": (2048, 8192, 16)}  # hidden, intermediate, layers
M = 64


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from surge.engines.kernels import gate_up_streamk as sk
    from surge.engines.kernels import pdl as pdl_mod
    from surge.engines.kernels import splitk_gemm
    from surge.engines.kernels.decoder_fused import add_rmsnorm
    from surge.engines.kernels.gate_up import gate_up_silu, plan_for

    h, i, layers = SHAPES[args.shape]
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    w_gu = [(torch.randn(2 * i, h, device=dev) / h ** 0.5).to(bf) for _ in range(layers)]
    w_dn = [(torch.randn(h, i, device=dev) / i ** 0.5).to(bf) for _ in range(layers)]
    x = torch.randn(M, h, device=dev, dtype=bf)
    tile_plan = plan_for(i, h)
    down_plan = splitk_gemm.plan_for(h, i)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plans = [sk.StreamKPlan(programs=p, block_k=bk, num_stages=st) for p in (sms, 2 * sms) for bk, st in
             ((128, 4), (128, 3), (64, 4))]
    pdls = (False, True) if pdl_mod.supported() else (False,)
    report = {"shape": args.shape, "tile_plan": str(tile_plan), "alone": [], "chain": []}

    ref = gate_up_silu(x, w_gu[0], tile_plan)
    works = {}
    for plan in plans:
        works[plan] = [sk.workspace(w, plan) for w in w_gu]
        out = sk.gate_up_silu_streamk(x, w_gu[0], plan, *works[plan][0])
        diff = (out.float() - ref.float()).abs().max().item()
        print(f"check {plan}: max |stream-K - tile kernel| {diff:.3g}, pieces a tile {sk._grid(w_gu[0], plan)[3]}",
              flush=True)

    def gu(plan, li, a, pdl):
        if plan is None:
            return gate_up_silu(a, w_gu[li], tile_plan, pdl=pdl)
        return sk.gate_up_silu_streamk(a, w_gu[li], plan, *works[plan][li], pdl=pdl)

    print(f"\n{args.shape}: gate/up alone, {layers} layers' weights in one graph, M = {M}, us a layer")
    for plan in [None] + plans:
        for pdl in pdls:
            t = timed(lambda: [gu(plan, li, x, pdl) for li in range(layers)]) / layers
            name = f"tile kernel {tile_plan}" if plan is None else str(plan)
            report["alone"].append({"plan": name, "pdl": pdl, "us": t})
            print(f"  {t:7.2f}  {name}, pdl={pdl}", flush=True)

    norms = [1 + torch.rand(h, device=dev, dtype=bf) for _ in range(layers)]
    resid = torch.randn(M, h, device=dev, dtype=bf)

    def chain(plan, pdl):
        def run():
            a = add_rmsnorm(resid, None, norms[0], 1e-6, pdl=pdl)
            for li in range(layers):
                part = splitk_gemm.partials(gu(plan, li, a, pdl), w_dn[li], down_plan, pdl=pdl)
                a = add_rmsnorm(resid, part, norms[li], 1e-6, pdl=pdl)
        return run

    best = sorted((r for r in report["alone"] if r["plan"] != f"tile kernel {tile_plan}"), key=lambda r: r["us"])
    top = [p for p in plans if str(p) in {r["plan"] for r in best[:2]}]
    print(f"\nthe MLP half of a layer (add_rmsnorm -> gate/up -> split-K down -> add_rmsnorm), us a layer")
    for plan in [None] + top:
        for pdl in pdls:
            t = timed(chain(plan, pdl)) / layers
            name = f"tile kernel {tile_plan}" if plan is None else str(plan)
            report["chain"].append({"plan": name, "pdl": pdl, "us": t})
            print(f"  {t:7.2f}  {name}, pdl={pdl}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 18: the MLP half of 24 layers as one persistent kernel whose weights stream into shared memory by TMA
(engines/kernels/tma_mlp.py, Gluon) against the decode step's three kernels a layer (PDL on and off) and session
14's persistent kernel (engines/kernels/persistent_mlp.py, its best plan), Qwen2-0.5B's shapes at M = 64.

Checks first: each kernel's result within the three-kernel chain's own error of a float64 reference (with the
kernels' rounding points), the barrier counter. Timing as gpu_persistent_mlp.py: one CUDA graph for all 24 layers
(the counter's zeroing inside it), median of 7 timings of 20 replays, us a layer; TB/s counts the MLP weights only.

    PYTHONPATH=src python3 benchmarks/gpu_tma_mlp.py [--json out.json]
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
from gpu_persistent_mlp import EPS, H, I, LAYERS, M, mlp_operands, reference64, three_kernel_chain  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--layers", type=int, default=LAYERS)
    args = ap.parse_args()
    from surge.engines.kernels import pdl as pdl_mod
    from surge.engines.kernels import persistent_mlp as pm
    from surge.engines.kernels import tma_mlp as tm

    layers = args.layers
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wgu, wd, norms, resid0 = mlp_operands(layers)
    weight_bytes = 3 * H * I * 2
    chain = three_kernel_chain(norms, wgu, wd)
    r_ref, h_ref = reference64(resid0, norms, wgu, wd)

    def err(h):
        return ((h.double() - h_ref.double()).norm() / h_ref.double().norm()).item()

    chain_err = err(chain(resid0.clone(), False))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "m": M, "i": I, "h": H,
              "layers": layers, "sms": sms, "chain_rel_err": chain_err, "rows": []}
    print(f"{report['device']}, {sms} SMs; three-kernel chain rel err {chain_err:.2e} against float64", flush=True)
    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    bound = max(2 * chain_err, 1e-3)

    candidates = [("tma", dict(programs=p)) for p in (sms, 128, 122) if p <= sms]
    candidates += [("tma_per_layer", dict(programs=sms, pdl=pdl)) for pdl in (True, False)]
    candidates.append(("persistent", dict(programs=2 * sms, block_g=32, block_k=128, block_d=32, block_kd=128,
                                          splits=8, num_warps=4, num_stages=3, prefetch=False)))
    def per_layer(resid, norms, wgu, wd, eps, counter, programs, pdl):
        """One launch a layer (PDL: each asks for its weights while the previous one runs), the counter running on."""
        h, arrivals = torch.empty_like(resid), 0
        for layer in range(wgu.shape[0]):
            tm.tma_mlp(resid, norms, wgu, wd, eps, counter, programs=programs, layers=(layer, layer + 1),
                       arrivals=arrivals, out=h, pdl=pdl)
            arrivals += tm.barriers(layer + 1, layer) * programs
        return h

    for kind, kw in candidates:
        try:
            fn = {"tma": tm.tma_mlp, "tma_per_layer": per_layer, "persistent": pm.persistent_mlp}[kind]
            r = resid0.clone()
            counter.zero_()
            h_out = fn(r, norms, wgu, wd, EPS, counter=counter, **kw)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a plan that does not compile or fit is reported
            print(f"  {kind} {kw}: skipped ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
            continue
        e = err(h_out)
        expected = (1 + 2 * layers) if kind == "tma_per_layer" else 3 * layers
        count_ok = int(counter.item()) == expected * kw["programs"]
        resid_err = ((r.double() - r_ref.double()).norm() / r_ref.double().norm()).item()
        row = {"kind": kind, **kw, "rel_err": e, "resid_rel_err": resid_err, "counter_ok": count_ok}
        if not (e < bound and count_ok):
            print(f"  WRONG {row}", flush=True)
            report["rows"].append(row)
            continue

        def run(fn=fn, kw=kw, r=r):
            counter.zero_()
            fn(r, norms, wgu, wd, EPS, counter=counter, **kw)
        row["us_per_layer"] = timed(run) / layers
        row["tb_s"] = weight_bytes / row["us_per_layer"] / 1e6
        report["rows"].append(row)
        print(f"  {kind} {kw}: {row['us_per_layer']:.2f} us a layer ({row['tb_s']:.2f} TB/s of weights), rel err "
              f"{e:.2e}", flush=True)
    # where the one launch's time goes: the same launch with only some phases computing (the others only wait for
    # their weights); 0 = weight streaming and barriers alone
    report["phases_us_per_layer"] = {}
    r = resid0.clone()
    for work in (0, 4, 1, 2, 3, 7):
        def run(work=work):
            counter.zero_()
            tm.tma_mlp(r, norms, wgu, wd, EPS, counter, programs=sms, work=work)
        t = report["phases_us_per_layer"][work] = timed(run) / layers
        print(f"  tma, phases computing {work} (1 gate/up, 2 down, 4 norm): {t:.2f} us a layer", flush=True)
    base = {}
    for pdl in ([False, True] if pdl_mod.supported() else [False]):
        r = resid0.clone()
        base[str(pdl)] = timed(lambda pdl=pdl, r=r: chain(r, pdl)) / layers
        print(f"  three kernels a layer, pdl={pdl}: {base[str(pdl)]:.2f} us a layer "
              f"({weight_bytes / base[str(pdl)] / 1e6:.2f} TB/s)", flush=True)
    report["chain_us_per_layer"] = base
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

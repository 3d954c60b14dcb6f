"""Where 8-bit weights should leave the split-K kernel for cuBLAS: the layer GEMMs above the decode step's 64 rows.

Per layer GEMM of a benchmarks/generate.py shape (qkv, o, up_gate with its SiLU product, down), at each row count
of --rows, us a layer (the model's layers' distinct weights in one CUDA graph; median of 7 timings of 20 replays,
gpu_decode_gemms.timed):

* kernel: the engine's 8-bit path up to splitk_gemm.Q8_MAX_M: the split-K kernel on the 8-bit tiles with the
  weight's Q8 plan and its reduce (gate/up then silu_mul);
* dequant + cuBLAS: the engine's path above it: the weight dequantized for the call by kernels/dequant.py;
* torch dequant + cuBLAS: the same with models/weight_quant.dequantize (session 36's path);
* BF16: cuBLAS on the BF16 weight, the baseline a BF16 model runs.

Each 8-bit path's output is checked against the float64 product of the dequantized weight first. Prints the table,
each row count's sum over the four GEMMs and the largest row count at which the kernel's sum wins (what
Q8_MAX_M should be), and the dequantization alone (us and GB/s of bytes moved).

    PYTHONPATH=src python3 benchmarks/gpu_q8_rows.py [--kind int8] [--shape llama-1b] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode_gemms import layer_dims, timed  # noqa: E402

ROWS = (64, 96, 128, 192, 256, 384, 512, 1024)
PATHS = ("kernel", "dequant + cuBLAS", "torch dequant + cuBLAS", "BF16")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2-0.5b", help="a benchmarks/generate.py shape")
    ap.add_argument("--kind", choices=["fp8", "int8"], default="fp8")
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from surge.engines.kernels import splitk_gemm as sk
    from surge.engines.kernels.decoder_fused import silu_mul
    from surge.engines.kernels.dequant import dequantize as dequant_kernel
    from surge.models.weight_quant import dequantize as dequant_torch
    from surge.models.weight_quant import quantize

    dims = layer_dims(args.shape)
    h, i, layers = dims["h"], dims["i"], dims["layers"]
    gemms = {"qkv": (dims["qkv"], h), "o": (h, h), "up_gate": (2 * i, h), "down": (h, i)}
    g = torch.Generator(device="cuda").manual_seed(0)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape,
              "kind": args.kind, "q8_max_m": sk.Q8_MAX_M, "gemms": {}, "dequant_us": {}}
    for name, (n, k) in gemms.items():
        wb = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(layers)]
        w8 = [quantize(w, args.kind) for w in wb]
        plan = sk.q8_plan_for(n, k)
        tail = (lambda y: silu_mul(y, torch.bfloat16)) if name == "up_gate" else (lambda y: y)
        paths = {
            "kernel": lambda x, q, s, w: tail(sk.linear(x, q, plan, scale=s)),
            "dequant + cuBLAS": lambda x, q, s, w: tail(F.linear(x, dequant_kernel(q, s, torch.bfloat16))),
            "torch dequant + cuBLAS": lambda x, q, s, w: tail(F.linear(x, dequant_torch(q, s, torch.bfloat16))),
            "BF16": lambda x, q, s, w: tail(F.linear(x, w)),
        }
        q0, s0 = w8[0]
        assert torch.equal(dequant_kernel(q0, s0, torch.bfloat16), dequant_torch(q0, s0, torch.bfloat16)), name
        deq_us = timed(lambda: [dequant_kernel(q, s, torch.bfloat16) for q, s in w8]) / layers
        torch_deq_us = timed(lambda: [dequant_torch(q, s, torch.bfloat16) for q, s in w8]) / layers
        record["dequant_us"][name] = {"kernel": deq_us, "torch": torch_deq_us, "gb_s": n * k * 3 / deq_us / 1e3}
        by_m = {}
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = x.double() @ (q0.double() * s0.double()[:, None]).T
            if name == "up_gate":
                gate, up = ref[:, :n // 2], ref[:, n // 2:]
                ref = gate * torch.sigmoid(gate) * up
            for p, fn in paths.items():
                if p == "BF16":
                    continue
                err = ((fn(x, q0, s0, wb[0]).double() - ref).norm() / ref.norm()).item()
                if err > 1e-2:
                    raise SystemExit(f"{name} M={m} {p}: relative error {err:.2e} against float64")
            by_m[m] = {p: timed(lambda: [fn(x, q, s, w) for (q, s), w in zip(w8, wb)]) / layers
                       for p, fn in paths.items()}
            print(f"{name} M={m}: " + ", ".join(f"{p} {t:.2f}" for p, t in by_m[m].items()), flush=True)
        record["gemms"][name] = {"n": n, "k": k, "plan": str(plan), "by_m": by_m}

    print(f"\n{args.shape}, {args.kind} weights, {layers} layers' distinct weights a graph, us a layer "
          f"({record['device']}); kernel / dequant + cuBLAS / torch dequant + cuBLAS / BF16:")
    print("| GEMM | " + " | ".join(f"M = {m}" for m in args.rows) + " |")
    print("| --- |" + " ---: |" * len(args.rows))
    sums = {m: {p: 0.0 for p in PATHS} for m in args.rows}
    for name, r in record["gemms"].items():
        cells = []
        for m in args.rows:
            t = r["by_m"][m]
            cells.append(" / ".join(f"{t[p]:.1f}" for p in PATHS))
            for p in PATHS:
                sums[m][p] += t[p]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("| all four | " + " | ".join(" / ".join(f"{sums[m][p]:.1f}" for p in PATHS) for m in args.rows) + " |")
    wins = [m for m in args.rows if sums[m]["kernel"] <= sums[m]["dequant + cuBLAS"]]
    best = max(wins) if wins else None
    print(f"\nthe kernel's four GEMMs beat dequant + cuBLAS at M = {wins} (largest {best}); "
          f"splitk_gemm.Q8_MAX_M is {sk.Q8_MAX_M}")
    print("dequantization alone, us a layer (kernel / torch; kernel GB/s of bytes moved): " + ", ".join(
        f"{n} {d['kernel']:.1f} / {d['torch']:.1f} ({d['gb_s']:.0f})" for n, d in record["dequant_us"].items()))
    record["sums"], record["kernel_wins_at"] = sums, wins
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

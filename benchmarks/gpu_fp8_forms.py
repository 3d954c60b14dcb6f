"""8-bit products on the GPU, every form side by side: is there a batch and a model size at which FP8 beats BF16?

Sessions 36-37 measured the engine's 8-bit weights slower than BF16 at the Qwen2-0.5B shape at every batch (weight-only:
each tile converted to BF16 in the kernel, or the weight dequantized for the call above 64 rows). vLLM's FP8 on Hopper
is another form: W8A8, each activation row quantized to E4M3 with its own scale as it comes, both operands FP8 in the
tensor cores (cuBLASLt through `torch._scaled_mm`, row-wise scales). This script times, per layer GEMM of a shape
(qkv, o, up_gate with its SiLU product, down; the LM head apart), at each row count of --rows, us a layer (the
layers' distinct weights in one CUDA graph, median of 7 timings of 20 replays, gpu_decode_gemms.timed):

* BF16 cuBLAS: F.linear on the BF16 weight (what a BF16 model runs above the decode kernels' rows);
* BF16 engine: the decode step's split-K / gate-up kernels on the BF16 weight (rows <= 64);
* FP8 weight-only: the engine's `--generation quantization=fp8` (the 8-bit kernel up to Q8_MAX_M rows, the
  dequantization kernel + cuBLAS above);
* W8A8 scaled_mm: the activation already FP8 (what a norm or SiLU kernel that also quantizes its output would hand
  over), `torch._scaled_mm` with row-wise scales, BF16 out;
* W8A8 + quant: the same with the activation quantized by its own Triton kernel first (one row a program).

Every FP8 output is checked first: W8A8 against the float64 product of the dequantized operands (its own reference),
weight-only against the float64 product of the dequantized weight; the W8A8 result's distance from the BF16 product
is printed (what FP8 activations cost in accuracy). Shapes: benchmarks/generate.py's plus `llama-8b` (Llama-3-8B's
4096 / 14336 / 32 q / 8 kv heads, --layers8b layers of distinct weights: more than the L2 holds).

    PYTHONPATH=src python3 benchmarks/gpu_fp8_forms.py [--shape qwen2-0.5b --shape llama-1b --shape llama-8b]
        [--rows 16 64 128 256] [--json out.json] [--plot out.png]
    python3 benchmarks/gpu_fp8_forms.py --plot out.png --from out.json   # the plot of a saved record, no GPU
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

PATHS = ("BF16 cuBLAS", "BF16 engine", "FP8 weight-only", "W8A8 scaled_mm", "W8A8 + quant")
LLAMA_8B = {"h": 4096, "i": 14336, "nq": 32, "nkv": 8, "d": 128, "qkv": 6144, "layers": 32, "vocab": 128256}


def dims_of(shape: str) -> dict:
    return dict(LLAMA_8B) if shape == "llama-8b" else layer_dims(shape)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def plot(record: dict, out: Path) -> None:
    """Each shape's four layer GEMMs: every 8-bit form's speed against the faster BF16 form, by rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = record["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes), 3.8), sharey=True, squeeze=False)
    for ax, (shape, rec) in zip(axes[0], shapes.items()):
        sums = {int(m): v for m, v in rec["sums"].items()}
        rows = sorted(sums)
        for p, style in zip(PATHS[2:], ("s--", "o-", "^:")):
            ratio = [min(v for q, v in sums[m].items() if q.startswith("BF16") and v) / sums[m][p] for m in rows]
            ax.plot(rows, ratio, style, label=p)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(rows, [str(m) for m in rows])
        ax.set_title(f"{shape} ({rec['layers']} layers' GEMMs)")
        ax.set_xlabel("rows (sequences in a decode step)")
    axes[0][0].set_ylabel("speed against the faster BF16 form (x)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"8-bit products against BF16 per layer, {record['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", choices=["qwen2-0.5b", "llama-1b", "llama-8b"])
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--layers8b", type=int, default=4)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="a PNG of each form's speed against BF16 by rows")
    ap.add_argument("--from", dest="src", type=Path, help="plot this saved --json record instead of measuring")
    args = ap.parse_args()
    if args.src:
        if not args.plot:
            ap.error("--from needs --plot")
        plot(json.loads(args.src.read_text()), args.plot)
        return
    from surge.engines.kernels import gate_up as gu
    from surge.engines.kernels import splitk_gemm as sk
    from surge.engines.kernels.decoder_fused import silu_mul
    from surge.engines.kernels.dequant import dequantize as dequant_kernel
    from surge.engines.kernels.fp8_rows import quantize_rows as quant_rows
    from surge.engines.kernels.fp8_rows import scaled_linear
    from surge.models.weight_quant import quantize
    from surge.models.weight_quant import quantize_rows as quant_rows_ref

    same = []
    for trial in range(3):  # the quantization kernel's codes and scales against the torch reference's
        x = (torch.randn(37, 896 * (trial + 1), device="cuda") * 10 ** trial).to(torch.bfloat16)
        (q, s), (qr, sr) = quant_rows(x), quant_rows_ref(x)
        same.append(torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr))
    print(f"quant_rows = its torch reference bit for bit: {same}", flush=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "q8_max_m": sk.Q8_MAX_M,
              "quant_rows_equal": same, "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shape or ["qwen2-0.5b", "llama-1b", "llama-8b"]:
        d = dims_of(shape)
        h, i = d["h"], d["i"]
        layers = args.layers8b if shape == "llama-8b" else d["layers"]
        gemms = {"qkv": (d["qkv"], h, layers), "o": (h, h, layers), "up_gate": (2 * i, h, layers),
                 "down": (h, i, layers), "lm_head": (d["vocab"], h, 1)}
        rec = record["shapes"][shape] = {"layers": layers, "gemms": {}}
        for name, (n, k, nl) in gemms.items():
            wb = [(torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(nl)]
            w8 = [quantize(w, "fp8") for w in wb]
            gate = name == "up_gate"
            tail = (lambda y: silu_mul(y, torch.bfloat16)) if gate else (lambda y: y)
            if gate:
                bplan, qplan = gu.plan_for(i, k) or gu.default_plan(i, k), gu.q8_plan_for(i, k)
                engine_bf16 = lambda x, w: gu.gate_up_silu(x, w, bplan)  # noqa: E731
                engine_q8 = lambda x, q, s: gu.gate_up_silu(x, q, qplan, scale=s)  # noqa: E731
            else:
                bplan, qplan = sk.plan_for(n, k) or sk.default_plan(n, k), sk.q8_plan_for(n, k)
                engine_bf16 = lambda x, w: sk.linear(x, w, bplan)  # noqa: E731
                engine_q8 = lambda x, q, s: sk.linear(x, q, qplan, scale=s)  # noqa: E731
            by_m = {}
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                xq = quant_rows(x)
                small = m <= sk.Q8_MAX_M
                paths = {
                    "BF16 cuBLAS": lambda w, q, s: tail(F.linear(x, w)),
                    "BF16 engine": (lambda w, q, s: engine_bf16(x, w)) if small and name != "lm_head" else None,
                    "FP8 weight-only": (lambda w, q, s: engine_q8(x, q, s)) if small and name != "lm_head" else
                    (lambda w, q, s: tail(F.linear(x, dequant_kernel(q, s, torch.bfloat16)))),
                    "W8A8 scaled_mm": lambda w, q, s: tail(scaled_linear(xq[0], xq[1], q, s)),
                    "W8A8 + quant": lambda w, q, s: tail(scaled_linear(*quant_rows(x), q, s)),
                }
                q0, s0 = w8[0]
                wdq = q0.double() * s0.double()[:, None]
                xdq = xq[0].double() * xq[1].double()
                refs = {"w": x.double() @ wdq.T, "w8a8": xdq @ wdq.T, "bf16": x.double() @ wb[0].double().T}
                if gate:
                    refs = {key: r[:, :n // 2] * torch.sigmoid(r[:, :n // 2]) * r[:, n // 2:]
                            for key, r in refs.items()}
                errs = {}
                for p, fn in paths.items():
                    if fn is None or p == "BF16 cuBLAS":
                        continue
                    try:
                        out = fn(wb[0], q0, s0)
                    except Exception as exc:  # a form this torch / GPU lacks: recorded, not fatal
                        print(f"{shape} {name} M={m} {p}: {type(exc).__name__}: {exc}", flush=True)
                        paths[p] = None
                        continue
                    own = refs["w8a8"] if p.startswith("W8A8") else refs["bf16" if p == "BF16 engine" else "w"]
                    errs[p] = rel(out, own)
                    if errs[p] > 1e-2:
                        raise SystemExit(f"{shape} {name} M={m} {p}: relative error {errs[p]:.2e} against float64")
                if paths["W8A8 scaled_mm"] is not None:  # what FP8 activations cost against the BF16 model
                    errs["W8A8 vs BF16 product"] = rel(paths["W8A8 scaled_mm"](wb[0], q0, s0), refs["bf16"])
                t = {p: (timed(lambda: [fn(w, q, s) for w, (q, s) in zip(wb, w8)]) / nl
                         if fn is not None else None) for p, fn in paths.items()}
                by_m[m] = {"us": t, "rel_err": errs}
                print(f"{shape} {name} M={m}: " + ", ".join(f"{p} {v:.2f}" for p, v in t.items() if v is not None)
                      + f" | W8A8 vs BF16 product {errs.get('W8A8 vs BF16 product', float('nan')):.2e}", flush=True)
            rec["gemms"][name] = {"n": n, "k": k, "mb_bf16": n * k * 2 / 1e6, "by_m": by_m}

    for shape, rec in record["shapes"].items():
        print(f"\n{shape} ({rec['layers']} layers' distinct weights a graph; {record['device']}), us a layer: "
              + " / ".join(PATHS))
        rows = args.rows
        print("| GEMM | MB BF16 | " + " | ".join(f"M = {m}" for m in rows) + " |")
        print("| --- | ---: |" + " ---: |" * len(rows))
        sums = {m: {p: 0.0 for p in PATHS} for m in rows}
        for name, r in rec["gemms"].items():
            cells = []
            for m in rows:
                t = r["by_m"][m]["us"]
                cells.append(" / ".join("-" if t[p] is None else f"{t[p]:.1f}" for p in PATHS))
                if name != "lm_head":
                    for p in PATHS:
                        sums[m][p] = None if (sums[m][p] is None or t[p] is None) else sums[m][p] + t[p]
            print(f"| {name} | {r['mb_bf16']:.1f} | " + " | ".join(cells) + " |")
        print("| the four | | " + " | ".join(" / ".join("-" if sums[m][p] is None else f"{sums[m][p]:.1f}"
                                                          for p in PATHS) for m in rows) + " |")
        for m in rows:
            best_bf16 = min(v for p, v in sums[m].items() if p.startswith("BF16") and v is not None)
            print(f"M = {m}: the four GEMMs' speed against the faster BF16 form: " + ", ".join(
                f"{p} {best_bf16 / sums[m][p]:.2f}x" for p in PATHS[2:] if sums[m][p]))
        rec["sums"] = sums
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    if args.plot:
        plot(record, args.plot)


if __name__ == "__main__":
    main()

"""The CPU decode step's linear layers in each weight form, in one run: what bounds a step of GPT-2 small.

12 layers of GPT-2 small's four linear shapes (768 -> 2304, 768 -> 768, 768 -> 3072, 3072 -> 768), distinct weights
(more than the caches hold, as in a real step), at 1-32 rows; ms a pass, median of --rounds:

- fp32 [out, in] (F.linear) and fp32 [in, out] (x @ W): the two layouts engines/decoder/cpu_layout.py chooses from;
- bf16 [out, in] and bf16 [in, out]: the same in BF16 (the baseline of the ratio column: BF16 F.linear);
- int8 weights: torch._weight_int8pack_mm (BF16 activations, INT8 weights, a BF16 scale a row), a weight-only
  8-bit form that would halve BF16's bytes (session 36: not adopted);
- w8a8 oneDNN and w8a8 _int_mm: engines/decoder/cpu_w8a8.linear (`--generation quantization=w8a8`) on BF16
  activations, with oneDNN's quantized linear on weights packed at load (what the engine runs) and with
  torch._int_mm on the codes (its fallback); each includes the per-row quantization and the scaling.

--lm-head times GPT-2's LM head (768 -> 50257, one weight) instead of the layers.

    PYTHONPATH=src python3 benchmarks/cpu_linear_forms.py [--threads 2] [--rounds 5] [--lm-head]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from surge.engines.decoder import cpu_w8a8

LAYER_SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # (in, out)
HEAD_SHAPES = ((768, 50257),)
ROWS = (1, 4, 8, 16, 32)
FORMS = ("fp32 [out, in]", "fp32 [in, out]", "bf16 [out, in]", "bf16 [in, out]", "int8", "w8a8 oneDNN",
         "w8a8 _int_mm")


def weights(gen: torch.Generator, shapes, layers: int) -> dict:
    """Each form's weights, [layer][shape]."""
    forms = {k: [] for k in FORMS}
    for _ in range(layers):
        layer = [torch.randn(n, k, generator=gen) for k, n in shapes]
        forms["fp32 [out, in]"].append(layer)
        forms["fp32 [in, out]"].append([w.t().contiguous() for w in layer])
        forms["bf16 [out, in]"].append([w.bfloat16() for w in layer])
        forms["bf16 [in, out]"].append([w.bfloat16().t().contiguous() for w in layer])
        scales = [w.abs().amax(1) / 127 for w in layer]
        forms["int8"].append([(torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s.bfloat16())
                              for w, s in zip(layer, scales)])
        packed = list(cpu_w8a8.quantize_weights(dict(enumerate(w.bfloat16() for w in layer)),
                                                range(len(layer))).values())
        forms["w8a8 oneDNN"].append(packed)
        forms["w8a8 _int_mm"].append([cpu_w8a8.W8A8Weight(p.wq_t, p.sw) for p in packed])
    return forms


def one_pass(form: str, layers: list, xs: dict, shapes) -> None:
    for layer in layers:
        for (k, _), w in zip(shapes, layer):
            x = xs[k] if form.startswith("fp32") else xs[k].bfloat16()
            if form == "int8":
                torch._weight_int8pack_mm(x, *w)
            elif form.startswith("w8a8"):
                cpu_w8a8.linear(x, w)
            elif form.endswith("[in, out]"):
                x @ w
            else:
                F.linear(x, w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lm-head", action="store_true", help="GPT-2's LM head instead of its 12 layers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shapes, layers = (HEAD_SHAPES, 1) if args.lm_head else (LAYER_SHAPES, 12)
    forms = weights(gen, shapes, layers)
    names = list(forms)
    print(f"torch {torch.__version__}, {args.threads} threads, ms a pass of {layers} layers x {len(shapes)} shapes, "
          f"median of {args.rounds} interleaved rounds (x: bf16 [out, in]'s time over the form's, above 1 faster)\n")
    print("| rows | " + " | ".join(names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    for rows in ROWS:
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for k, _ in shapes}}
        times = {n: [] for n in names}
        for n in names:
            one_pass(n, forms[n], xs, shapes)  # first touch
        for _ in range(args.rounds):
            for n in names:
                t = time.perf_counter()
                one_pass(n, forms[n], xs, shapes)
                times[n].append(1e3 * (time.perf_counter() - t))
        med = {n: statistics.median(v) for n, v in times.items()}
        base = med["bf16 [out, in]"]
        print(f"| {rows} | " + " | ".join(f"{med[n]:.2f} ({base / med[n]:.2f}x)" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

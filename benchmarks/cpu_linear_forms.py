"""The CPU decode step's linear layers in each weight form, in one run: what bounds a step of GPT-2 small.

12 layers of GPT-2 small's four linear shapes (768 -> 2304, 768 -> 768, 768 -> 3072, 3072 -> 768), distinct weights
(more than the caches hold, as in a real step), at 1-32 rows; ms a pass, median of --rounds:

- fp32 [out, in] (F.linear) and fp32 [in, out] (x @ W): the two layouts engines/decoder/cpu_layout.py chooses from;
- bf16 [out, in] and bf16 [in, out]: the same in BF16 (the baseline of the ratio column: BF16 F.linear);
- int8 weights: torch._weight_int8pack_mm (BF16 activations, INT8 weights, a BF16 scale a row), a weight-only
  8-bit form that would halve BF16's bytes (session 36: not adopted).

    python3 benchmarks/cpu_linear_forms.py [--threads 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # (in, out)
LAYERS = 12
ROWS = (1, 4, 8, 16, 32)


def weights(gen: torch.Generator) -> dict:
    """Each form's weights, [layer][shape]."""
    forms = {k: [] for k in ("fp32 [out, in]", "fp32 [in, out]", "bf16 [out, in]", "bf16 [in, out]", "int8")}
    for _ in range(LAYERS):
        layer = [torch.randn(n, k, generator=gen) for k, n in SHAPES]
        forms["fp32 [out, in]"].append(layer)
        forms["fp32 [in, out]"].append([w.t().contiguous() for w in layer])
        forms["bf16 [out, in]"].append([w.bfloat16() for w in layer])
        forms["bf16 [in, out]"].append([w.bfloat16().t().contiguous() for w in layer])
        scales = [w.abs().amax(1) / 127 for w in layer]
        forms["int8"].append([(torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s.bfloat16())
                              for w, s in zip(layer, scales)])
    return forms


def one_pass(form: str, layers: list, xs: dict) -> None:
    for layer in layers:
        for (k, _), w in zip(SHAPES, layer):
            x = xs[k] if form.startswith("fp32") else xs[k].bfloat16()
            if form == "int8":
                torch._weight_int8pack_mm(x, *w)
            elif form.endswith("[in, out]"):
                x @ w
            else:
                F.linear(x, w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    forms = weights(gen)
    names = list(forms)
    print(f"torch {torch.__version__}, {args.threads} threads, ms a pass of {LAYERS} layers x 4 shapes, "
          f"median of {args.rounds} interleaved rounds (x: bf16 [out, in]'s time over the form's, above 1 faster)\n")
    print("| rows | " + " | ".join(names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    for rows in ROWS:
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for k, _ in SHAPES}}
        times = {n: [] for n in names}
        for n in names:
            one_pass(n, forms[n], xs)  # first touch
        for _ in range(args.rounds):
            for n in names:
                t = time.perf_counter()
                one_pass(n, forms[n], xs)
                times[n].append(1e3 * (time.perf_counter() - t))
        med = {n: statistics.median(v) for n, v in times.items()}
        base = med["bf16 [out, in]"]
        print(f"| {rows} | " + " | ".join(f"{med[n]:.2f} ({base / med[n]:.2f}x)" for n in names) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The layout the CPU keeps a decoder's linear weights in: [in, out], which `x @ W` runs as a plain (NN)
GEMM, or [out, in], which `F.linear` runs as an NT GEMM. Each layout is faster on some machine: on session
34's 2-core Xeon [in, out] ran an 8-row decode step's linears 1.43x faster and GPT-2's LM head 2.06x
(benchmarks/cpu_parts.py); on session 36's 2-core AMD EPYC keeping the layers [out, in] made the engine's
GPT-2 small decode 1.07x faster in FP32 and BF16 (docs/benchmarks/generate.md, session 36). So by default
the engine measures both on its own weights where it loads (`choose`), at the rows of its decode steps, and
keeps the faster; the layers and the LM head are chosen apart (their shapes differ); weights small enough
for the caches are not timed. Either layout gives the same products up to floating-point rounding.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

LAYOUTS = ("auto", "in_out", "out_in")
MAX_ROWS = 32  # above this a step is a prefill chunk's, where the two layouts are within ~10% of each other
SAMPLE_LAYERS = 4  # layers timed at most: more weights than the caches hold, as in a real step ...
SAMPLE_BYTES = 64 << 20  # ... and no more layers once this much is sampled (the timing copies what it samples)
# Below this many bytes a group's weights sit in the caches and both layouts take microseconds: timings would
# pick at random, and engines of one model could differ in rounding. Such groups keep in_out, as before.
MIN_BYTES = 8 << 20


def _is_linear(name: str, t: torch.Tensor, linear: tuple[str, ...]) -> bool:
    return name.rsplit(".", 1)[-1] in linear and t.dim() == 2


def choose(w: dict, linear: tuple[str, ...], rows: int, repeats: int = 3, timer=time.perf_counter,
           min_bytes: int = MIN_BYTES) -> dict:
    """{"layers": layout, "lm_head": layout}: for each group, "in_out" or "out_in", whichever took less time
    (median of `repeats` interleaved timings, each after one untimed call) to multiply `rows` random rows
    (at most MAX_ROWS) by the group's weights: the first SAMPLE_LAYERS layers' linear weights together, or
    the LM head. A group with no weights, or fewer than `min_bytes` bytes of them, gets "in_out" untimed.
    The layers' group stops at the first layer that brings it to SAMPLE_BYTES (a big model: one layer).
    `timer`: seconds, as time.perf_counter."""
    rows = max(1, min(rows, MAX_ROWS))
    layers = []
    for i in range(SAMPLE_LAYERS):
        if sum(t.nbytes for _, t in layers) >= SAMPLE_BYTES:
            break
        layers += [(n, t) for n, t in w.items() if _is_linear(n, t, linear) and n.startswith(f"l{i}.")]
    groups = {"layers": layers, "lm_head": [("lm_head", w["lm_head"])] if "lm_head" in w else []}
    return {g: _faster(ts, rows, repeats, timer) if sum(t.nbytes for _, t in ts) >= max(min_bytes, 1) else "in_out"
            for g, ts in groups.items()}


def _faster(named: list, rows: int, repeats: int, timer) -> str:
    gen = torch.Generator().manual_seed(0)
    forms = []
    for _, t in named:
        nt = t.contiguous()  # [out, in]
        x = torch.randn(rows, nt.shape[1], generator=gen).to(t.dtype)
        forms.append((x, nt, nt.t().contiguous()))

    def run(layout: str) -> float:
        start = timer()
        for x, nt, nn in forms:
            if layout == "in_out":
                torch.matmul(x, nn)
            else:
                F.linear(x, nt)
        return timer() - start

    times = {"in_out": [], "out_in": []}
    for layout in times:
        run(layout)  # first touch: pages, BLAS's packing buffers
    for _ in range(repeats):
        for layout in times:
            times[layout].append(run(layout))
    return min(times, key=lambda k: (statistics.median(times[k]), k))


def lay_out(w: dict, linear: tuple[str, ...], layers: str = "in_out", lm_head: str = "in_out") -> dict:
    """Put the weights of `w` in the layouts asked for, in place, and return {name: [in, out] tensor} for those
    kept [in, out] (the dict keeps a transposed view of the same storage, so F.linear still works on it);
    those kept [out, in] are made contiguous that way and left out of the result. A head tied to the
    embedding and laid out [in, out] gets its own copy (the embedding needs its rows)."""
    for arg, value in (("layers", layers), ("lm_head", lm_head)):
        if value not in LAYOUTS[1:]:
            raise ValueError(f"{arg} layout must be in_out or out_in, not {value!r}")
    out = {}
    for name, t in list(w.items()):
        if _is_linear(name, t, linear):
            if layers == "in_out":
                out[name] = t.t().contiguous()  # no copy when the dict already holds such a view
                w[name] = out[name].t()
            else:
                w[name] = t.contiguous()
    if "lm_head" in w:
        if lm_head == "in_out":
            out["lm_head"] = w["lm_head"].t().contiguous()
            if "embed" not in w or w["lm_head"].data_ptr() != w["embed"].data_ptr():
                w["lm_head"] = out["lm_head"].t()
        else:
            w["lm_head"] = w["lm_head"].contiguous()
    return out

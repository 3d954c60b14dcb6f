"""What a decode step's LoRA deltas cost each module's GEMM, joined into its kernel or as two kernels (GPU).

    PYTHONPATH=src python3 benchmarks/gpu_lora_join.py [--shape qwen2-0.5b] [--slots 2 --slots 4] [--json OUT]

For each adaptable module of the shape (qkv, o, up_gate, down) at M = 64 rows dealt round robin over the
slots (every row an adapter row, as generate_lora's adapter rows): the layers' distinct weights (so that L2
does not hold them across layers) and stacked slots of rank `--rank`, one CUDA graph per variant of a call a
layer, PDL on as in the engine, replayed back to back (median of 5 x 50 replays, us a call):

* base: the engine's decode kernel for the module (the split-K partials, or the one-kernel gate/up);
* joined: the same kernel with the LoRA operands (kernels/lora_delta.py: x A^T in its K loop), where the
  module's stacked rank fits lora_delta.JOIN_MAX_R; with `--a-loads both` also the TMA kernels reading A's
  tiles by pointer loads (lora_delta.A_BY_TMA off) instead of by TMA;
* two kernels: the base kernel, then lora_shrink and lora_expand_ on one stream (the engine begins the shrink
  on a side stream; for gate/up the engine's form: cuBLAS, the delta, silu_mul).

The deltas' cost a step is the sum over modules x layers; the table prints it against the base kernels'.
No readers follow the GEMMs, so a kernel's partials are not consumed: the costs are the GEMMs' own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from generate import SHAPES, replay_us  # noqa: E402

M = 64


def module_shapes(kw: dict, rank: int) -> dict[str, tuple[int, int, int]]:
    """module -> (N, K, width) of the shape's fused weights (widths as engines/decoder/lora.LoraBank's)."""
    h, i = kw["hidden_size"], kw["intermediate_size"]
    d = h // kw["num_attention_heads"]
    qkv = (kw["num_attention_heads"] + 2 * kw["num_key_value_heads"]) * d
    return {"qkv": (qkv, h, 3 * rank), "o": (h, h, rank), "up_gate": (2 * i, h, 2 * rank), "down": (h, i, rank)}


def variants(module: str, n: int, k: int, layers: int, slots: int, width: int, g: torch.Generator,
             both: bool = False) -> dict:
    """variant -> a function of the layer that runs it (None where it does not apply)."""
    import torch.nn.functional as F

    from surge.engines.kernels import gate_up, pdl, splitk_gemm
    from surge.engines.kernels.decoder_fused import silu_mul
    from surge.engines.kernels.lora_delta import JOIN_MAX_R, LoraOperands, lora_expand_, lora_shrink

    dt, dev = torch.bfloat16, "cuda"
    on = pdl.supported()
    ws = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dt) for _ in range(layers)]
    a = [(torch.randn(slots * width, k, generator=g) / k ** 0.5).to(dev, dt) for _ in range(layers)]
    b = [(torch.randn(n, slots * width, generator=g) * 0.1).to(dev, dt) for _ in range(layers)]
    x = torch.randn(M, k, generator=g).to(dev, dt)
    rows = (torch.arange(M) % slots + 1).to(dev)
    joinable = slots * width <= JOIN_MAX_R
    if module == "up_gate":
        plan = gate_up.plan_for(n // 2, k)

        def base(i):
            return gate_up.gate_up_silu(x, ws[i], plan, pdl=on)

        def joined(i):
            return gate_up.gate_up_silu(x, ws[i], plan, pdl=on, lora=LoraOperands(a[i], b[i], rows, width))

        def two(i):
            out = F.linear(x, ws[i])
            lora_expand_(out, lora_shrink(x, a[i], rows, width, pdl=on), b[i], rows, width, pdl=on)
            return silu_mul(out, pdl=on)
    else:
        plan = splitk_gemm.plan_for(n, k)

        def base(i):
            return splitk_gemm.partials(x, ws[i], plan, pdl=on)

        def joined(i):
            return splitk_gemm.partials(x, ws[i], plan, pdl=on, lora=LoraOperands(a[i], b[i], rows, width))

        def two(i):
            out = splitk_gemm.partials(x, ws[i], plan, pdl=on)
            lora_expand_(out[0], lora_shrink(x, a[i], rows, width, pdl=on), b[i], rows, width, pdl=on)
            return out
    if plan is None:
        raise SystemExit(f"{module}: no measured decode plan for ({n}, {k})")
    from surge.engines.kernels import lora_delta

    def joined_by_pointer(i):
        lora_delta.A_BY_TMA = False
        try:
            return joined(i)
        finally:
            lora_delta.A_BY_TMA = True

    return {"base": base, "joined": joined if joinable else None,
            "joined, A by pointer": joined_by_pointer if joinable and both else None, "two kernels": two}


def time_variant(fn, layers: int) -> float:
    for i in range(layers):  # compile and allocate outside the capture
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    return replay_us(graph) / layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2-0.5b", choices=["qwen2-0.5b", "llama-1b"])
    ap.add_argument("--slots", type=int, action="append")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--a-loads", choices=["tma", "both"], default="tma")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    kw = SHAPES[args.shape][1]
    layers = kw["num_hidden_layers"]
    out = {"shape": args.shape, "rank": args.rank, "gpu": torch.cuda.get_device_name(), "rows": []}
    for slots in args.slots or [2]:
        g = torch.Generator().manual_seed(slots)
        print(f"\n{args.shape}, M = {M} rows over {slots} slots of rank {args.rank}, {layers} layers a graph, "
              f"us a call (PDL on), {out['gpu']}")
        print("| module | stacked columns | base | joined | +joined | A by pointer | two kernels | +two kernels |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        totals = {"base": 0.0, "joined": 0.0, "two kernels": 0.0}
        for module, (n, k, width) in module_shapes(kw, args.rank).items():
            fns = variants(module, n, k, layers, slots, width, g, both=args.a_loads == "both")
            us = {name: (time_variant(fn, layers) if fn is not None else None) for name, fn in fns.items()}
            joined = us["joined"] if us["joined"] is not None else us["two kernels"]  # the engine's choice
            totals["base"] += us["base"] * layers
            totals["joined"] += joined * layers
            totals["two kernels"] += us["two kernels"] * layers
            j = "-" if us["joined"] is None else f"{us['joined']:.2f}"
            dj = "-" if us["joined"] is None else f"{us['joined'] - us['base']:+.2f}"
            ptr = us["joined, A by pointer"]
            print(f"| {module} | {slots * width} | {us['base']:.2f} | {j} | {dj} | "
                  f"{'-' if ptr is None else f'{ptr:.2f}'} | {us['two kernels']:.2f} | "
                  f"{us['two kernels'] - us['base']:+.2f} |")
            out["rows"].append({"slots": slots, "module": module, "columns": slots * width, **us})
        print(f"| a step ({layers} layers) | | {totals['base']:.0f} | {totals['joined']:.0f} (engine's choice) | "
              f"{totals['joined'] - totals['base']:+.0f} | | {totals['two kernels']:.0f} | "
              f"{totals['two kernels'] - totals['base']:+.0f} |")
        out[f"totals_{slots}"] = totals
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Launch shapes of the decode step's one-kernel attention (engines/kernels/decode_attention.py), issue 18.

A decode step at 64 streams of a benchmarks/generate.py shape (--shape; Qwen2-0.5B by default: 14 query /
2 kv heads of 64, the QKV GEMM's output as 7 split-K partials plus the bias; llama-1b: 32 / 8 heads, 4
partials, no bias: the split count of the shape's QKV plan), contexts drawn from 129-256 tokens (the middle
of a 128 + 128 round), the model's layers' distinct caches. Every (keys per tile, warps, stages) is checked against the two-kernel path
(rope_and_cache + paged_attention, bit for bit where the tile is the same) and timed as 24 launches in one
CUDA graph (median of 7 timings of 20 replays), next to the two-kernel path, in both of the kernel's forms
(with and without session 21's PREFETCH_FIRST_TILE: "l2" / "barrier"), with each compiled variant's registers and
spills; --pdl: each form's
2 best launches again with every kernel launched with PDL. Prints a table; --json.

    PYTHONPATH=src python3 benchmarks/gpu_decode_attention.py [--shape llama-1b] [--pdl] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode_gemms import layer_dims, timed  # noqa: E402

B, PAGE = 64, 16
# the kernel's forms: the first key tile's lines asked into L2 before the PDL wait or not (PREFETCH_FIRST_TILE)
FORMS = ("barrier", "l2")


def compiled_registers(jit_fn) -> dict:
    """(kv form, BLOCK_N, warps, stages, PDL) -> registers a thread and spills of each compiled variant of the
    kernel (Triton's JIT cache; empty where its internals differ)."""
    out = {}
    try:
        for caches in jit_fn.device_caches.values():
            for kernel in caches[0].values():
                c = {jit_fn.arg_names[k[0]]: v for k, v in kernel.src.constants.items() if len(k) == 1}
                key = (FORMS[bool(c.get("PREFETCH"))], c["BLOCK_N"], kernel.metadata.num_warps, kernel.metadata.num_stages,
                       bool(c.get("PDL")))
                out[key] = {"n_regs": kernel.n_regs, "n_spills": kernel.n_spills}
    except Exception as exc:  # a Triton whose cache is laid out otherwise: the table without the columns
        print(f"  no register counts: {type(exc).__name__}: {exc}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--shape", default="qwen2-0.5b", help="a benchmarks/generate.py shape")
    ap.add_argument("--pdl", action="store_true", help="also each form's 4 best launches with PDL")
    args = ap.parse_args()
    from generate import SHAPES as MODELS

    from surge.engines.kernels.splitk_gemm import plan_for

    dims = layer_dims(args.shape)
    NQ, NKV, D, LAYERS = dims["nq"], dims["nkv"], dims["d"], dims["layers"]
    qkv_plan = plan_for(dims["qkv"], dims["h"])
    SPLITS = qkv_plan.num_splits(dims["h"]) if qkv_plan else 1
    has_bias = MODELS[args.shape][0] == "qwen2"
    from surge.engines.decoder.attention import AttnMeta
    from surge.engines.kernels.decode_attention import LAUNCH, decode_attention
    from surge.engines.kernels.decoder_fused import rope_and_cache
    from surge.engines.kernels.paged_attention import paged_attention

    g = torch.Generator().manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    ctxs = torch.randint(129, 257, (B,), generator=g).tolist()
    per = 256 // PAGE
    nb = B * per + 1
    perm = torch.randperm(B * per, generator=g)
    tables = perm.view(B, per).to(dev, torch.int32)
    slots = torch.tensor([int(tables[i, (c - 1) // PAGE]) * PAGE + (c - 1) % PAGE for i, c in enumerate(ctxs)],
                         device=dev)
    meta = AttnMeta(slots, tables, torch.tensor(ctxs, dtype=torch.int32, device=dev),
                    torch.arange(B + 1, dtype=torch.int32, device=dev), 1, [1] * B, ctxs, tables.tolist())
    pos = torch.tensor([c - 1 for c in ctxs], device=dev)
    kc = [torch.randn(nb, PAGE, NKV, D, generator=g).to(dev, bf) for _ in range(LAYERS)]
    vc = [torch.randn(nb, PAGE, NKV, D, generator=g).to(dev, bf) for _ in range(LAYERS)]
    width = (NQ + 2 * NKV) * D
    qkv = (torch.randn(SPLITS, B, width, generator=g) / SPLITS ** 0.5).to(dev)
    bias = torch.randn(width, generator=g).to(dev, bf) if has_bias else None
    inv = MODELS[args.shape][1].get("rope_theta", 1e4) ** (-torch.arange(0, D, 2) / D)
    emb = torch.arange(1024, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat([emb, emb], -1)
    cos, sin = emb.cos().to(dev, bf), emb.sin().to(dev, bf)
    scale = D ** -0.5

    def split(block_n):
        def run():
            for li in range(LAYERS):
                q = rope_and_cache(qkv, cos, sin, pos, slots, kc[li], vc[li], NQ, NKV, D, bias=bias)
                paged_attention(q, kc[li], vc[li], meta, scale, block_n=block_n)
        return run

    rows = []
    ref = {}
    for bn in (64, 128, 256):
        k0, v0 = kc[0].clone(), vc[0].clone()
        q = rope_and_cache(qkv, cos, sin, pos, slots, k0, v0, NQ, NKV, D, bias=bias)
        ref[bn] = paged_attention(q, k0, v0, meta, scale, block_n=bn)
        rows.append({"path": "rope_and_cache + paged_attention", "block_n": bn, "num_warps": 4, "num_stages": 2,
                     "us": timed(split(bn)) / LAYERS, "equal": True})
    from surge.engines.kernels import decode_attention as da

    def fused(bn, nw, st, form, pdl, li=0, kc=kc, vc=vc):
        da.PREFETCH_FIRST_TILE = form == "l2"
        return decode_attention(qkv, cos, sin, pos, slots, kc[li], vc[li], meta, scale, NQ, NKV, D, bias=bias,
                                block_n=bn, num_warps=nw, num_stages=st, pdl=pdl)

    for form in FORMS:
        for bn in (64, 128, 256):
            for nw in (2, 4, 8):
                for st in (1, 3):
                    try:
                        out = fused(bn, nw, st, form, False, kc=[kc[0].clone()], vc=[vc[0].clone()])
                        err = (out.float() - ref[bn].float()).abs().max().item()
                        if not err < 2e-2:
                            print(f"  WRONG {form} block_n {bn} warps {nw} stages {st}: max err {err}", flush=True)
                            continue
                        t = timed(lambda: [fused(bn, nw, st, form, False, li) for li in range(LAYERS)]) / LAYERS
                    except Exception as exc:
                        print(f"  failed {form} block_n {bn} warps {nw} stages {st}: {type(exc).__name__}: "
                              f"{str(exc)[:100]}")
                        continue
                    rows.append({"path": "decode_attention", "kv_form": form, "pdl": False, "block_n": bn,
                                 "num_warps": nw, "num_stages": st, "us": t, "equal": bool(torch.equal(out, ref[bn]))})
    if args.pdl:  # the 2 best launches of each form again, every kernel launched with PDL (each one's pre-wait
        # part overlapping the previous layer's attention: not the engine's predecessor, the QKV GEMM)
        for form in FORMS:
            for r in sorted((r for r in rows if r.get("kv_form") == form), key=lambda r: r["us"])[:2]:
                bn, nw, st = r["block_n"], r["num_warps"], r["num_stages"]
                out = fused(bn, nw, st, form, True, kc=[kc[0].clone()], vc=[vc[0].clone()])
                t = timed(lambda: [fused(bn, nw, st, form, True, li) for li in range(LAYERS)]) / LAYERS
                rows.append({"path": "decode_attention", "kv_form": form, "pdl": True, "block_n": bn,
                             "num_warps": nw, "num_stages": st, "us": t, "equal": bool(torch.equal(out, ref[bn]))})
    da.PREFETCH_FIRST_TILE = True
    regs = compiled_registers(da._decode_attn)
    for r in rows:
        r.update(regs.get((r.get("kv_form"), r["block_n"], r["num_warps"], r["num_stages"], r.get("pdl")), {}))
    print(f"\n{args.shape}: {NQ} / {NKV} heads of {D}, {SPLITS} qkv partials, bias {has_bias}; 64 streams, contexts "
          f"129-256, us a layer ({LAYERS} layers in one graph); default launch {LAUNCH}")
    print("| path | kv form | pdl | keys a tile | warps | stages | us | registers | spills | bits equal to the "
          "two-kernel path |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in sorted(rows, key=lambda r: r["us"]):
        print(f"| {r['path']} | {r.get('kv_form', '')} | {r.get('pdl', False)} | {r['block_n']} | {r['num_warps']} | "
              f"{r['num_stages']} | {r['us']:.2f} | {r.get('n_regs', '')} | {r.get('n_spills', '')} | {r['equal']} |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape, "rows": rows},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The 8-bit weight paths under Triton's interpreter, on a machine without a GPU (session 35 had none).

Needs `pip install triton` (CI has none; the interpreter runs FP16, not BF16). Three checks, each against float64
or an FP32 model on the dequantized weights, printed as relative errors:

1. the split-K and gate/up kernels' pointer forms on FP8 / INT8 weights (swapped and not, K not a multiple of the
   tiles);
2. their TMA forms, launched directly with host descriptors;
3. the fused Llama-family layer (models/weight_quant.py weights, decode_gemm "splitk"): a prefill of 80 tokens (the
   dequantized-weight path) and three decode steps (the qkv partials read by rope_and_cache, the norms' readers,
   gate/up and down with their scales) against the same model in FP32 on the CPU. The fused decode attention
   prefetches by inline PTX, which the interpreter cannot run: the split RoPE + paged attention stands in.

    PYTHONPATH=src:. python3 scripts/q8_interpret.py [fp8|int8]
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def kernels(kind: str) -> None:
    from surge.engines.kernels import gate_up as gu
    from surge.engines.kernels import splitk_gemm as sk
    from surge.models.weight_quant import quantize

    g = torch.Generator().manual_seed(0)
    for n, k, plan in [(96, 128, sk.SplitKPlan(32, 64, 2)), (96, 192, sk.SplitKPlan(32, 64, 2, swap=True)),
                       (80, 200, sk.SplitKPlan(32, 64, 3))]:
        q, s = quantize(torch.randn(n, k, generator=g) * 0.05, kind)
        a = torch.randn(7, k, generator=g).half()
        ref = a.double() @ (q.double() * s.double()[:, None]).T
        print(f"split-K pointer {n}x{k} swap={plan.swap}: {_rel(sk.partials(a, q, plan, scale=s).sum(0), ref):.2e}")
    i, k = 64, 128
    q, s = quantize(torch.randn(2 * i, k, generator=g) * 0.05, kind)
    x = torch.randn(5, k, generator=g).half()
    for swap in (False, True):
        out = gu.gate_up_silu(x, q, gu.GateUpPlan(32, 64, swap=swap), scale=s)
        print(f"gate/up pointer swap={swap}: {_rel(out, _silu_ref(x, q, s, i)):.2e} (FP16 rounding ~5e-4)")


def _silu_ref(x, q, s, i):
    dq = q.double() * s.double()[:, None]
    gate = (x.double() @ dq[:i].T).half().double()
    up = (x.double() @ dq[i:].T).half().double()
    return (gate * torch.sigmoid(gate)).half().double() * up


def tma_kernels(kind: str) -> None:
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    from surge.engines.kernels import gate_up as gu
    from surge.engines.kernels import splitk_gemm as sk
    from surge.engines.kernels.lora_delta import lora_args
    from surge.models.weight_quant import quantize

    def desc(t, block):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block))

    g = torch.Generator().manual_seed(1)
    for swap in (False, True):
        n, k, m = 96, 256, 7
        plan = sk.SplitKPlan(32, 64, 2, swap=swap, tma=True)
        q, s = quantize(torch.randn(n, k, generator=g) * 0.05, kind)
        a = torch.randn(m, k, generator=g).half()
        ks = plan.k_split(k)
        out = torch.empty(triton.cdiv(k, ks), m, n)
        lkw = lora_args(None, a, n, q)
        wd = desc(q, (plan.block_n, plan.block_k))
        sk._partials_tma[(triton.cdiv(n, plan.block_n), triton.cdiv(k, ks), 1)](
            desc(a, (64, plan.block_k)), wd, q, out, m, n, k, q.stride(0), s, wd, *lkw["args"], W_SCALE=True,
            K_SPLIT=ks, SWAP=swap, BLOCK_M=64, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, PDL=False, LINES=4,
            **lkw["constexprs"], LA_TMA=False)
        ref = a.double() @ (q.double() * s.double()[:, None]).T
        print(f"split-K TMA swap={swap}: {_rel(out.sum(0), ref):.2e}")
        i = 64
        q, s = quantize(torch.randn(2 * i, k, generator=g) * 0.05, kind)
        o = torch.empty(m, i).half()
        lkw = lora_args(None, a, 2 * i, q)
        wd = desc(q, (32, 64))
        gu._gate_up_tma[(2, 1)](desc(a, (64, 64)), wd, q, o, m, i, k, q.stride(0), o.stride(0), s, wd, *lkw["args"],
                                W_SCALE=True, SWAP=swap, BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, PDL=False, LINES=4,
                                **lkw["constexprs"], LA_TMA=False)
        print(f"gate/up TMA swap={swap}: {_rel(o, _silu_ref(a, q, s, i)):.2e}")


def fused_layer(kind: str) -> None:
    from surge.engines.decoder.attention import AttnMeta
    from surge.engines.decoder.model import DecoderModel, KVCache
    from surge.engines.kernels import splitk_gemm
    from surge.models.decoder import load_decoder_config, load_decoder_weights
    from surge.models.weight_quant import SCALE_SUFFIX, dequantize
    from tests.decoder_models import build_model

    d = build_model("qwen2", Path(tempfile.mkdtemp()) / "q", seed=3, hidden_size=128, intermediate_size=256,
                    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    cfg = load_decoder_config(d)
    w8 = load_decoder_weights(d, cfg, torch.float16, quantize=kind)
    # built on the CPU (the interpreter's device): the 8-bit weights attached after __init__'s GPU-only check,
    # the CPU's [in, out] layout off (the kernels read [out, in] rows)
    DecoderModel._cpu_layout = classmethod(lambda cls, w: {})
    plain = {k: v for k, v in w8.items() if not k.endswith(SCALE_SUFFIX)}
    m = DecoderModel(cfg, plain, torch.device("cpu"), torch.float16, attention="triton", decode_gemm="splitk",
                     decode_attention="split")
    m._scales = {k.removesuffix(SCALE_SUFFIX): v for k, v in w8.items() if k.endswith(SCALE_SUFFIX)}
    m._splitk, m._gate_up = m._splitk_plans("splitk"), m._gate_up_plans("splitk")
    m._q8_plans = {k: splitk_gemm.q8_plan_for(*m.w[k].shape) for k in m._scales}
    m._q8_max_m, m._q8_linear_kernel = splitk_gemm.MAX_M, splitk_gemm.linear
    assert m.fused and m.quantization == kind and len(m._splitk) == 4 * cfg.num_layers
    wref = {k: (dequantize(v, w8[k + SCALE_SUFFIX], torch.float32) if k + SCALE_SUFFIX in w8 else v.float())
            for k, v in w8.items() if not k.endswith(SCALE_SUFFIX)}
    ref = DecoderModel(cfg, wref, torch.device("cpu"), torch.float32, attention="torch")
    kv, kvr = KVCache(cfg, 16, 16, "cpu", torch.float16), KVCache(cfg, 16, 16, "cpu", torch.float32)
    n = 80
    table = torch.arange(6, dtype=torch.int32)[None]

    def meta(pos, ctx):
        return AttnMeta(torch.tensor(pos), table, torch.tensor([ctx], dtype=torch.int32),
                        torch.tensor([0, len(pos)], dtype=torch.int32), len(pos), [len(pos)], [ctx], [list(range(6))])

    ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        lo = m.logits(m.forward(ids, torch.arange(n), kv, meta(list(range(n)), n))[-1:])
        lr = ref.logits(ref.forward(ids, torch.arange(n), kvr, meta(list(range(n)), n))[-1:])
        print(f"fused layer, prefill of {n} (dequantized weights): logits {_rel(lo, lr):.2e}")
        tok = int(lr.argmax())
        for step in range(3):
            p = n + step
            x = torch.tensor([tok])
            lo = m.logits(m.forward(x, torch.tensor([p]), kv, meta([p], p + 1)))
            lr = ref.logits(ref.forward(x, torch.tensor([p]), kvr, meta([p], p + 1)))
            print(f"fused layer, decode step {step} (8-bit kernels): logits {_rel(lo, lr):.2e}, argmax "
                  f"{int(lo.argmax())} / {int(lr.argmax())}")
            tok = int(lr.argmax())


if __name__ == "__main__":
    for kind in sys.argv[1:] or ["fp8", "int8"]:
        print(f"== {kind}")
        kernels(kind)
        tma_kernels(kind)
        fused_layer(kind)

"""surge's BERT-family encoder over packed tokens [T, H].

Two implementations of the same layer math:

* `forward_reference`: plain PyTorch ops (any device, any dtype; CPU CI runs it).
  Attention runs per sequence, so packed input needs no padding.
* `forward_fused`: the GPU path: cuBLAS GEMMs (QKV fused into one) and Triton
  kernels (embedding+LN, packed FlashAttention-style attention, bias+GeLU,
  bias+residual+LN) writing into a preallocated workspace, so that one CUDA
  graph per shape bucket replays the whole model.

Layer functions take the head count from the layer's weights, and an optional
`reduce` callable for partial sums: a tensor-parallel variant (heads and FFN
columns split over GPUs, `encoder_weights.shard_layer`) passes an all-reduce.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from surge.engines.encoder_weights import EncoderConfig, EncoderWeights, LayerWeights

Reduce = Callable[[torch.Tensor], torch.Tensor] | None


def position_ids(lengths, offset: int):
    """Per-token positions of a packed batch (numpy in, numpy out)."""
    import numpy as np

    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) == 1:  # a lone sequence (the latency case): one range, without the per-sequence starts
        return np.arange(offset, offset + int(lengths[0]), dtype=np.int64)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum()), dtype=np.int64) - starts + offset


# ---------------------------------------------------------------- reference path

def _act(x: torch.Tensor, kind: str) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


def embed_reference(w: EncoderWeights, ids, types, pos) -> torch.Tensor:
    x = w.word[ids] + w.pos[pos] + w.types[types if w.config.type_vocab else torch.zeros_like(types)]
    return F.layer_norm(x, (w.config.hidden,), w.emb_ln_w, w.emb_ln_b, w.config.eps)


def attention_reference(qkv: torch.Tensor, cu: list[int], heads: int) -> torch.Tensor:
    hid = qkv.shape[1] // 3
    d = hid // heads
    out = torch.empty(qkv.shape[0], hid, dtype=qkv.dtype, device=qkv.device)
    for s, e in zip(cu[:-1], cu[1:]):
        if e == s:
            continue
        q, k, v = (qkv[s:e, j * hid:(j + 1) * hid].reshape(e - s, heads, d).transpose(0, 1) for j in range(3))
        out[s:e] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(e - s, hid)
    return out


def layer_reference(x: torch.Tensor, lw: LayerWeights, cu: list[int], cfg: EncoderConfig,
                    reduce: Reduce = None) -> torch.Tensor:
    red = reduce or (lambda t: t)
    qkv = F.linear(x, lw.wqkv, lw.bqkv)
    ctx = attention_reference(qkv, cu, lw.heads)
    h = F.layer_norm(x + red(F.linear(ctx, lw.wo)) + lw.bo, (cfg.hidden,), lw.ln1_w, lw.ln1_b, cfg.eps)
    f = _act(F.linear(h, lw.w1, lw.b1), cfg.activation)
    return F.layer_norm(h + red(F.linear(f, lw.w2)) + lw.b2, (cfg.hidden,), lw.ln2_w, lw.ln2_b, cfg.eps)


def forward_reference(w: EncoderWeights, ids: torch.Tensor, types: torch.Tensor, pos: torch.Tensor,
                      cu: list[int]) -> torch.Tensor:
    x = embed_reference(w, ids, types, pos)
    for lw in w.layers:
        x = layer_reference(x, lw, cu, w.config)
    return x


# ---------------------------------------------------------------- fused GPU path

def layer_fused(x: torch.Tensor, lw: LayerWeights, cu: torch.Tensor, max_len: int, batch: int,
                cfg: EncoderConfig, ws: dict[str, torch.Tensor], reduce: Reduce = None, gemm: str = "cublas") -> None:
    """One layer, in place on x [T, H].

    ws: 'qkv' [T, 3*hid] and 'ffn' [C, ffn] (the same bytes), 'tmp' [C, H];
    C <= T is the chunk the out-projection and the FFN run in (memory.py).
    gemm: "cublas" (cuBLAS GEMMs, bias+GeLU as its own Triton kernel), "cublaslt_gelu"
    (cuBLAS, bias+GeLU in cuBLASLt's epilogue, tanh form), "triton"
    (every GEMM in Triton, bias+GeLU in the FFN GEMM's epilogue), "mixed"
    (cuBLAS, except the FFN-in GEMM with the fused epilogue) or "invariant" (as "triton",
    with one GEMM tiling and one attention tile for every batch: a token's output is bit for
    bit the same whatever else the batch holds; the other modes choose by shape).
    """
    from surge.engines.kernels.attention import varlen_attention
    from surge.engines.kernels.gemm import ACT_GELU, ACT_GELU_TANH
    from surge.engines.kernels.norm import bias_gelu_

    tanh = cfg.activation == "gelu_tanh"
    qkv, tmp_full, ffn_full = ws["qkv"], ws["tmp"], ws["ffn"]
    hid = qkv.shape[1] // 3
    t, chunk = x.shape[0], tmp_full.shape[0]
    triton_gemm = _triton_linear(gemm)
    if triton_gemm is not None:
        triton_gemm(x, lw.wqkv, lw.bqkv, qkv)
    else:
        torch.addmm(lw.bqkv, x, lw.wqkv.t(), out=qkv)  # fused QKV; bias in cuBLASLt's epilogue
    ctx = qkv[:, :hid]  # the context overwrites Q in place: no [T, hid] buffer of its own
    varlen_attention(qkv, cu, ctx, lw.heads, max_len, batch, invariant=gemm == "invariant")
    for c0 in range(0, t, chunk):
        c1 = min(t, c0 + chunk)
        _project_add_ln(ctx[c0:c1], lw.wo, lw.bo, x[c0:c1], tmp_full[:c1 - c0], lw.ln1_w, lw.ln1_b, cfg.eps,
                        gemm, reduce)
    for c0 in range(0, t, chunk):  # qkv is dead from here: ffn reuses its bytes
        c1 = min(t, c0 + chunk)
        tmp, xc, ffn = tmp_full[:c1 - c0], x[c0:c1], ffn_full[:c1 - c0]
        if gemm == "cublas":
            torch.mm(xc, lw.w1.t(), out=ffn)
            bias_gelu_(ffn, lw.b1, tanh=tanh)
        elif gemm == "cublaslt_gelu":
            # bias + GeLU in cuBLASLt's epilogue: no pass over [C, ffn]; cuBLASLt's GeLU is the
            # tanh form, so the engine offers this mode only where that is allowed (approximate_gelu)
            torch._addmm_activation(lw.b1, xc, lw.w1.t(), use_gelu=True, out=ffn)
        else:  # "mixed" runs this GEMM in Triton too: its epilogue carries bias + GeLU
            (triton_gemm or _triton_linear("triton"))(xc, lw.w1, lw.b1, ffn, act=ACT_GELU_TANH if tanh else ACT_GELU)
        _project_add_ln(ffn, lw.w2, lw.b2, xc, tmp, lw.ln2_w, lw.ln2_b, cfg.eps, gemm, reduce)


# The residual enters the out-projection and FFN-out GEMMs as cuBLAS's C operand (beta = 1,
# in place on x), so the LayerNorm pass after them reads one [T, H] tensor less.
RESIDUAL_IN_GEMM = True


def _triton_linear(gemm: str):
    """The Triton GEMM a mode runs every product with (None: cuBLAS for the mode's others)."""
    from surge.engines.kernels.gemm import linear, linear_invariant

    return {"triton": linear, "invariant": linear_invariant}.get(gemm)


def _project_add_ln(a, w, bias, xc, tmp, ln_w, ln_b, eps: float, gemm: str, reduce: Reduce) -> None:
    """xc = LayerNorm(a @ w^T + bias + xc), in place on xc."""
    from surge.engines.kernels.norm import add_layernorm, bias_layernorm_

    triton_gemm = _triton_linear(gemm)
    if triton_gemm is not None:
        triton_gemm(a, w, None, tmp)
    elif reduce is None and RESIDUAL_IN_GEMM:
        xc.addmm_(a, w.t())
        bias_layernorm_(xc, bias, ln_w, ln_b, eps)
        return
    else:
        torch.mm(a, w.t(), out=tmp)
    # a tensor-parallel shard all-reduces its partial product before the residual is added
    add_layernorm(reduce(tmp) if reduce else tmp, bias, xc, ln_w, ln_b, eps, out=xc)


def forward_fused(w: EncoderWeights, inputs: torch.Tensor, tokens: int, batch: int, max_len: int,
                  ws: dict[str, torch.Tensor], gemm: str = "cublas", offload=None) -> torch.Tensor:
    """inputs: int32 [3*tokens + batch + 1] = ids | types | positions | cu_seqlens. Returns ws['x'].

    offload: a memory.OffloadedLayers that hands out each layer's weights
    (streamed from host memory) instead of w.layers.
    """
    from surge.engines.kernels.norm import embed_layernorm

    ids, types, pos = inputs[:tokens], inputs[tokens:2 * tokens], inputs[2 * tokens:3 * tokens]
    cu = inputs[3 * tokens:]
    x = ws["x"]
    stream = torch.cuda.current_stream() if offload is not None else None
    if offload is not None:
        offload.begin(stream)
    embed_layernorm(ids, types, pos, w.word, w.pos, w.types, w.emb_ln_w, w.emb_ln_b, w.config.eps, out=x)
    for i in range(w.config.layers):
        lw = offload.get(i, stream) if offload is not None else w.layers[i]
        layer_fused(x, lw, cu, max_len, batch, w.config, ws, gemm=gemm)
        if offload is not None:
            offload.done(i, stream)
    return x

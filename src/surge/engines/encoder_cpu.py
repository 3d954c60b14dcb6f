"""The CPU path of the torch engine: batched attention, oneDNN GEMMs, few ops per layer.

`encoder.forward_reference` runs attention one sequence at a time (a Python
loop of SDPA calls per layer), which makes a batch of 32 cost nearly 32 batch-1
runs. Here a packed batch [T, H] keeps its packed layout for every GEMM (no
padded tokens are multiplied), and only attention scatters Q/K/V into a
[B, heads, L, d] block padded to the longest sequence and runs ONE
scaled_dot_product_attention call for the whole batch with a key-padding mask
(PyTorch's fused CPU flash-attention kernel: softmax in fp32 even for bf16
inputs, no [B, heads, L, L] score tensor in bf16). A batch of one sequence skips
the mask and the scatter.

With bf16 weights every GEMM is a oneDNN bf16 GEMM, which uses AMX tiles on
CPUs that have them (Sapphire Rapids and later): there the GEMMs of a batch run
several times faster per token than of a single short sequence, so batching
pays. Embedding sums and LayerNorm statistics are computed in fp32 (torch's
CPU LayerNorm accumulates in fp32 for bf16 inputs); GeLU stays in bf16, because
converting [T, ffn] to fp32 and back costs more than the GeLU itself.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from surge.engines.encoder_weights import EncoderWeights


def _gelu(x: torch.Tensor, kind: str) -> torch.Tensor:
    return F.gelu(x, approximate="tanh" if kind == "gelu_tanh" else "none")


def embed(w: EncoderWeights, ids: torch.Tensor, types: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Embedding sum and LayerNorm in fp32 (T x H: cheap), returned in the weights' dtype."""
    cfg = w.config
    x = w.word[ids].float() + w.pos[pos].float()
    if cfg.type_vocab:
        x += w.types[types].float()
    else:
        x += w.types[0].float()
    x = F.layer_norm(x, (cfg.hidden,), w.emb_ln_w.float(), w.emb_ln_b.float(), cfg.eps)
    return x.to(w.word.dtype)


BIN_TOKENS = 64  # attention block size: short sequences share a block (block-diagonal mask)


class AttentionPlan:
    """How a packed batch is cut into attention blocks, and each block's mask.

    Consecutive sequences are packed into blocks of P = max(BIN_TOKENS, longest)
    tokens (first fit, in order); a block-diagonal mask keeps each sequence to
    its own keys. Fewer, larger blocks than one per sequence: PyTorch's CPU
    attention kernel costs a roughly fixed amount per (block, head) for short
    sequences, so 32 sequences of ~11 tokens in 6 blocks of 64 run about twice
    as fast as 32 blocks of 20. Sequences stay contiguous, so a block is a slice
    of the packed tensor (no gather/scatter by index).
    """

    def __init__(self, lengths: np.ndarray, bin_tokens: int = BIN_TOKENS):
        lengths = np.asarray(lengths, dtype=np.int64)
        self.tokens = int(lengths.sum())
        self.single = len(lengths) == 1
        if self.single:
            return
        p = max(bin_tokens, int(lengths.max()))
        bins: list[list[int]] = [[]]
        used = 0
        for n in lengths.tolist():
            if used + n > p:
                bins.append([])
                used = 0
            bins[-1].append(n)
            used += n
        self.block = p
        self.fill = [sum(b) for b in bins]  # real tokens per block; the rest of the block is padding
        # Segment id of every block position; padding gets -1, so padded queries attend to padded keys
        # only (never an empty row) and real queries never see them.
        seg = np.full((len(bins), p), -1, dtype=np.int64)
        for i, b in enumerate(bins):
            seg[i, :sum(b)] = np.repeat(np.arange(len(b)), b)
        seg_t = torch.from_numpy(seg)
        self.mask = (seg_t[:, :, None] == seg_t[:, None, :])[:, None]  # [blocks, 1, P, P], True = attend


def attention(qkv: torch.Tensor, plan: AttentionPlan, heads: int) -> torch.Tensor:
    """Packed qkv [T, 3*hid] -> packed context [T, hid], one SDPA call for the batch."""
    t, three_hid = qkv.shape
    hid = three_hid // 3
    d = hid // heads
    if plan.single:
        q, k, v = qkv.view(1, t, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(t, hid)
    nb, p = len(plan.fill), plan.block
    if nb * p == t:
        blocks = qkv
    else:
        blocks = qkv.new_zeros(nb * p, three_hid)
        s = 0
        for i, n in enumerate(plan.fill):
            blocks[i * p:i * p + n] = qkv[s:s + n]
            s += n
    q, k, v = blocks.view(nb, p, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask)  # [blocks, heads, P, d]
    ctx = ctx.transpose(1, 2).reshape(nb * p, hid)
    if nb * p == t:
        return ctx
    return torch.cat([ctx[i * p:i * p + n] for i, n in enumerate(plan.fill)])


def _has_fused_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") \
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


class CpuEncoder:
    """An encoder's weights prepared for the CPU, and its forward pass over packed batches.

    fused=True (the default where PyTorch is built with oneDNN): every weight is
    reordered once, at load, into oneDNN's blocked layout (AMX/VNNI tiles for
    bf16), instead of on every call, which is most of a short batch's GEMM time;
    bias + GeLU and bias + residual add run in the GEMM's epilogue, so a layer
    is 4 GEMMs, 2 LayerNorms and the attention call, with no separate
    elementwise passes over [T, ffn]. fused=False: plain F.linear (any build).
    """

    PACK_HINT = 64  # oneDNN picks the blocked layout for this many rows; any row count runs on it

    def __init__(self, w: EncoderWeights, fused: bool | None = None):
        self.w = w
        self.config = w.config
        if fused is None:  # oneDNN's fp16 GEMMs need AVX512-FP16/AMX-FP16: fp16 keeps plain F.linear
            fused = _has_fused_linear() and w.word.dtype in (torch.float32, torch.bfloat16)
        self.fused = fused
        self.gelu_algo = "tanh" if w.config.activation == "gelu_tanh" else "none"
        pack = (lambda t: torch.ops.mkldnn._reorder_linear_weight(t, self.PACK_HINT)) if self.fused else (lambda t: t)
        # Per layer: packed weights (the originals stay in `w`, shared with other engines).
        self.layers = [(pack(lw.wqkv), pack(lw.wo), pack(lw.w1), pack(lw.w2)) for lw in w.layers]

    def _linear(self, x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor, act: str | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        if not self.fused:
            y = F.linear(x, wt, b)
            if act is not None:
                y = _gelu(y, self.config.activation)
            return y if residual is None else y.add_(residual)
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, wt, b, "add")
        if act is not None:
            return torch.ops.mkldnn._linear_pointwise(x, wt, b, "gelu", [], self.gelu_algo)
        return torch.ops.mkldnn._linear_pointwise(x, wt, b, "none", [], "")

    def forward(self, ids: torch.Tensor, types: torch.Tensor, pos: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
        """Last hidden state [T, H] (in the weights' dtype) of a packed batch."""
        cfg = self.config
        plan = AttentionPlan(lengths)
        x = embed(self.w, ids, types, pos)
        norm = (cfg.hidden,)
        for lw, (wqkv, wo, w1, w2) in zip(self.w.layers, self.layers):
            qkv = self._linear(x, wqkv, lw.bqkv)  # fused QKV: one GEMM
            ctx = attention(qkv, plan, lw.heads)
            h = F.layer_norm(self._linear(ctx, wo, lw.bo, residual=x), norm, lw.ln1_w, lw.ln1_b, cfg.eps)
            f = self._linear(h, w1, lw.b1, act="gelu")
            x = F.layer_norm(self._linear(f, w2, lw.b2, residual=h), norm, lw.ln2_w, lw.ln2_b, cfg.eps)
        return x


def forward(w: EncoderWeights, ids: torch.Tensor, types: torch.Tensor, pos: torch.Tensor,
            lengths: np.ndarray) -> torch.Tensor:
    """One-off forward without prepared weights (plain F.linear); engines keep a CpuEncoder."""
    return CpuEncoder(w, fused=False).forward(ids, types, pos, lengths)

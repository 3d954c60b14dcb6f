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


class AttentionPlan:
    """Where each packed token sits in the padded [B, L] attention block, and the key mask."""

    def __init__(self, lengths: np.ndarray, dtype: torch.dtype):
        lengths = np.asarray(lengths, dtype=np.int64)
        self.batch = len(lengths)
        self.max_len = int(lengths.max())
        self.single = self.batch == 1
        if self.single:
            return
        starts = np.repeat(np.arange(self.batch, dtype=np.int64) * self.max_len, lengths)
        offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        self.index = torch.from_numpy(starts + offsets)  # packed token -> row of the padded block
        keep = np.arange(self.max_len)[None, :] < lengths[:, None]  # [B, L] real keys
        self.uniform = bool(keep.all())  # every sequence as long as the longest: no mask needed
        # A boolean mask broadcast over heads and queries: True = attend.
        self.mask = None if self.uniform else torch.from_numpy(keep)[:, None, None, :]


def attention(qkv: torch.Tensor, plan: AttentionPlan, heads: int) -> torch.Tensor:
    """Packed qkv [T, 3*hid] -> packed context [T, hid], one SDPA call for the batch."""
    t, three_hid = qkv.shape
    hid = three_hid // 3
    d = hid // heads
    if plan.single:
        q, k, v = qkv.view(1, t, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(t, hid)
    b, l = plan.batch, plan.max_len
    if plan.uniform:
        padded = qkv
    else:
        padded = qkv.new_zeros(b * l, three_hid)
        padded.index_copy_(0, plan.index, qkv)
    q, k, v = padded.view(b, l, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask)  # [B, heads, L, d]
    ctx = ctx.transpose(1, 2).reshape(b * l, hid)
    return ctx if plan.uniform else ctx.index_select(0, plan.index)


def forward(w: EncoderWeights, ids: torch.Tensor, types: torch.Tensor, pos: torch.Tensor,
            lengths: np.ndarray) -> torch.Tensor:
    """Last hidden state [T, H] (in the weights' dtype) of a packed batch."""
    cfg = w.config
    plan = AttentionPlan(lengths, w.word.dtype)
    x = embed(w, ids, types, pos)
    norm = (cfg.hidden,)
    for lw in w.layers:
        qkv = F.linear(x, lw.wqkv, lw.bqkv)  # fused QKV: one GEMM
        ctx = attention(qkv, plan, lw.heads)
        h = F.layer_norm(torch.add(x, F.linear(ctx, lw.wo, lw.bo)), norm, lw.ln1_w, lw.ln1_b, cfg.eps)
        f = _gelu(F.linear(h, lw.w1, lw.b1), cfg.activation)
        x = F.layer_norm(torch.add(h, F.linear(f, lw.w2, lw.b2)), norm, lw.ln2_w, lw.ln2_b, cfg.eps)
    return x

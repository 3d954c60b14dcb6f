"""The decoder embedder's CPU forward as one TorchScript call (Llama / Qwen2 / Qwen3 / Mistral / Granite layers).

engines/decoder/model.py's eager forward is ~20 torch calls a layer, and each call re-takes the GIL: beside
a server's busy event loop every take waits up to the interpreter's switch interval. Compiled with
torch.jit.script the whole layer stack runs in C++ without the GIL, as the encoder's CPU path does
(engines/encoder_cpu.py): beside one spinning Python thread it keeps 0.95x of its speed, the eager forward
0.52x (`benchmarks/decoder_embed.py --device cpu --threads 1 --busy-threads 1`, docs/benchmarks/decoder_embed.md).
The arithmetic is the eager layer's, op for op (its norm and RoPE are the same functions; tests: the two
agree within FP32 rounding on every layer kind): the fused q/k/v and gate/up GEMMs on [in, out] weights,
Qwen3's per-head norms, causal attention over the encoder's packed blocks (one SDPA call a layer), SwiGLU.
Granite's multipliers are already in the weights (models/decoder._fold_multipliers); absent biases and norms
are empty tensors.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F

from surge.engines.decoder.model import rms_norm, rope


def _linear(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if b.numel() > 0:
        return torch.addmm(b, x, wt)
    return x @ wt


def _linear_rows(x: torch.Tensor, wt: torch.Tensor, b: torch.Tensor, chunk: int) -> torch.Tensor:
    """_linear in calls of at most `chunk` rows, in order (0: one call): the batch-invariant form's GEMMs."""
    t = x.size(0)
    if chunk == 0 or t <= chunk:
        return _linear(x, wt, b)
    parts: List[torch.Tensor] = []
    for s in range(0, t, chunk):
        parts.append(_linear(x.narrow(0, s, min(chunk, t - s)), wt, b))
    return torch.cat(parts)


def _blocks(x: torch.Tensor, fill: List[int], block: int) -> torch.Tensor:
    """Packed [T, h, d] -> [blocks, h, P, d]; padding rows zero (the mask keeps them to themselves)."""
    nb = len(fill)
    if nb * block == x.size(0):
        out = x
    else:
        out = x.new_zeros(nb * block, x.size(1), x.size(2))
        s = 0
        d = 0
        for i in range(nb):
            out.narrow(0, d, fill[i]).copy_(x.narrow(0, s, fill[i]))
            s += fill[i]
            d += block
    return out.view(nb, block, x.size(1), x.size(2)).transpose(1, 2)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, fill: List[int], block: int,
               mask: Optional[torch.Tensor]) -> torch.Tensor:
    """q [T, heads, d], k / v [T, kv_heads, d] of packed sequences -> [T, heads, d], each causal on itself."""
    gqa = q.size(1) != k.size(1)
    if len(fill) == 0:  # one sequence
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                             v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                                             enable_gqa=gqa)
        return out[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(_blocks(q, fill, block), _blocks(k, fill, block), _blocks(v, fill, block),
                                         attn_mask=mask, scale=scale, enable_gqa=gqa)
    out = out.transpose(1, 2).reshape(len(fill) * block, q.size(1), q.size(2))
    if len(fill) * block == q.size(0):
        return out
    parts: List[torch.Tensor] = []
    for i in range(len(fill)):
        parts.append(out.narrow(0, i * block, fill[i]))
    return torch.cat(parts)


def _attention_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, blocks: List[int],
                         gathers: List[torch.Tensor], masks: List[torch.Tensor], back: torch.Tensor) -> torch.Tensor:
    """q [T, heads, d], k / v [T, kv_heads, d] -> [T, heads, d]: each sequence in a block of its own, at offset 0,
    of a size that follows its length alone (encoder_cpu.InvariantPlan, causal masks)."""
    gqa = q.size(1) != k.size(1)
    zq, zk = q.new_zeros(1, q.size(1), q.size(2)), k.new_zeros(1, k.size(1), k.size(2))
    qp, kp, vp = torch.cat([q, zq]), torch.cat([k, zk]), torch.cat([v, zk])  # row T: the blocks' padding
    outs: List[torch.Tensor] = []
    for g in range(len(blocks)):
        p = blocks[g]
        nb = gathers[g].size(0) // p
        qb = qp.index_select(0, gathers[g]).view(nb, p, q.size(1), q.size(2)).transpose(1, 2)
        kb = kp.index_select(0, gathers[g]).view(nb, p, k.size(1), k.size(2)).transpose(1, 2)
        vb = vp.index_select(0, gathers[g]).view(nb, p, k.size(1), k.size(2)).transpose(1, 2)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=masks[g], scale=scale, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(nb * p, q.size(1), q.size(2)))
    return torch.cat(outs).index_select(0, back)


def encode(ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           layers: List[List[torch.Tensor]], final_norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
           head_dim: int, scale: float, fill: List[int], block: int, mask: Optional[torch.Tensor],
           chunks: List[int], blocks: List[int], gathers: List[torch.Tensor], masks: List[torch.Tensor],
           back: torch.Tensor) -> torch.Tensor:
    """Packed token ids [T] -> hidden states after the final norm [T, hidden]. A layer's tensors: attn_norm,
    qkv [in, out], qkv bias, q_norm, k_norm, o [in, out], o bias, mlp_norm, up_gate [in, out], up_gate bias,
    down [in, out], down bias (absent ones empty).

    blocks empty: the batch's own attention layout (fill, block, mask: encoder_cpu.AttentionPlan, causal).
    Otherwise the batch-invariant one (InvariantPlan(causal=True): blocks, gathers, masks, back). chunks: per
    GEMM of a layer (QKV, output, gate/up, down), > 0: calls of at most that many rows; absent: one call."""
    t = ids.size(0)
    x = embed.index_select(0, ids)  # not F.embedding / embed[ids]: no op here may re-take the GIL
    c = cos.index_select(0, positions).unsqueeze(1)
    s = sin.index_select(0, positions).unsqueeze(1)
    qd = heads * head_dim
    kd = kv_heads * head_dim
    ck = chunks if len(chunks) == 4 else [0, 0, 0, 0]
    for w in layers:
        h = rms_norm(x, w[0], eps)
        qkv = _linear_rows(h, w[1], w[2], ck[0])
        q = qkv.narrow(1, 0, qd).reshape(t, heads, head_dim)
        k = qkv.narrow(1, qd, kd).reshape(t, kv_heads, head_dim)
        v = qkv.narrow(1, qd + kd, kd).reshape(t, kv_heads, head_dim)
        if w[3].numel() > 0:  # Qwen3: each head's query and key normalized, then rotated
            q = rms_norm(q, w[3], eps)
            k = rms_norm(k, w[4], eps)
        q = rope(q, c, s)
        k = rope(k, c, s)
        if len(blocks) > 0:
            a = _attention_invariant(q, k, v, scale, blocks, gathers, masks, back).reshape(t, qd)
        else:
            a = _attention(q.contiguous(), k.contiguous(), v.contiguous(), scale, fill, block, mask).reshape(t, qd)
        x = x + _linear_rows(a, w[5], w[6], ck[1])
        h = rms_norm(x, w[7], eps)
        gu = _linear_rows(h, w[8], w[9], ck[2])
        inter = gu.size(1) // 2
        x = x + _linear_rows(F.silu(gu.narrow(1, 0, inter)) * gu.narrow(1, inter, inter), w[10], w[11], ck[3])
    return rms_norm(x, final_norm, eps)


def scripted():
    """encode, compiled by TorchScript once per process."""
    from surge.engines.encoder_cpu import script_once

    return script_once(encode)


def layer_tensors(model) -> List[List[torch.Tensor]]:
    """A DecoderModel's (CPU, llama family) layers in encode's order; its [in, out] weights are views of the
    same storage as its own."""
    w, wt = model.w, model._wt
    empty = torch.empty(0, dtype=model.dtype)

    def get(name):
        return w.get(name, empty)

    out = []
    for i in range(model.cfg.num_layers):
        p = f"l{i}."
        out.append([w[p + "attn_norm"], wt[p + "qkv"], get(p + "qkv.bias"), get(p + "q_norm"), get(p + "k_norm"),
                    wt[p + "o"], get(p + "o.bias"), w[p + "mlp_norm"], wt[p + "up_gate"], get(p + "up_gate.bias"),
                    wt[p + "down"], get(p + "down.bias")])
    return out


def row_bounds(layer: List[torch.Tensor]) -> List[int]:
    """Per GEMM of a layer (QKV, output, gate/up, down): the largest row count per call under which its rows
    come out bit for bit the same whatever the call (row_bound.probe_bound), on this CPU, build and thread
    count. Every layer has the same shapes: the first answers for all."""
    from surge.engines.row_bound import probe_bound

    out = []
    for j in (1, 5, 8, 10):
        wt, b = layer[j], layer[j + 1]
        key = ("decoder-embed", tuple(wt.shape), wt.dtype, b.numel() > 0, torch.get_num_threads())
        out.append(probe_bound(lambda x, r, wt=wt, b=b: _linear(x, wt, b), wt.size(0), wt.size(1), wt.dtype, False,
                               key))
    return out

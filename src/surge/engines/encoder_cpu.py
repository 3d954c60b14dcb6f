"""The CPU path of the torch engine: packed oneDNN GEMMs, batched attention, one compiled call.

`encoder.forward_reference` runs attention one sequence at a time (a Python
loop of SDPA calls per layer), so a batch of 32 costs nearly 32 batch-1 runs,
and every op re-takes the GIL. Here:

* a packed batch [T, H] stays packed for every GEMM (no padded tokens are
  multiplied); only attention copies Q/K/V into blocks of >= 64 tokens, each
  holding several consecutive sequences, and runs ONE
  scaled_dot_product_attention call for the batch with a block-diagonal mask
  (PyTorch's CPU flash-attention kernel: softmax in fp32 even for bf16);
* weights are reordered once into oneDNN's blocked layout, and bias + GeLU and
  bias + residual run in the GEMM epilogue (`torch.ops.mkldnn._linear_pointwise`,
  the ops Inductor emits for CPU). With bf16 weights the GEMMs use AMX tiles on
  CPUs that have them (Sapphire Rapids and later), whose per-token cost falls
  several times from a 16-token sequence to a batch of hundreds of tokens, so
  batching pays;
* embedding sum and LayerNorms work in fp32 (the LayerNorm kernel accumulates
  in fp32 for bf16 inputs); GeLU runs in bf16 inside the GEMM;
* the whole forward is one TorchScript call that runs without the GIL.
"""

from __future__ import annotations

import threading
import warnings
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from surge.engines.encoder_weights import EncoderWeights


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

    def __init__(self, lengths: np.ndarray, bin_tokens: int = BIN_TOKENS, causal: bool = False):
        """causal: a query also never sees its own sequence's later keys (a decoder's attention)."""
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
        # [blocks, 1, P, P]: True = attend
        mask = seg[:, None, :, None] == seg[:, None, None, :]
        if causal:  # block positions keep their sequences' order, so the block's lower triangle is causal
            mask &= np.tri(p, dtype=bool)
        self.mask = torch.from_numpy(mask)


# ---------------------------------------------------------------- the layers (TorchScript source)
# Written in the TorchScript subset: compiled once (torch.jit.script), the whole
# layer stack runs in C++ with the GIL released. Run eagerly, each of its ~15
# ops per layer would re-take the GIL, and in a server whose event loop thread
# holds the GIL most of the time, every re-take waits for the interpreter's
# switch interval: measured 9x slower under a busy Python thread.

def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, gelu: bool, residual: Optional[torch.Tensor],
            fused: bool, gelu_tanh: bool) -> torch.Tensor:
    if fused:  # oneDNN with prepacked weights; bias + GeLU / bias + residual in the GEMM's epilogue
        if residual is not None:
            return torch.ops.mkldnn._linear_pointwise(x, residual, w, b, "add")
        if gelu:
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "gelu", [], "tanh" if gelu_tanh else "none")
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    y = F.linear(x, w, b)
    if gelu:
        y = F.gelu(y, approximate="tanh" if gelu_tanh else "none")
    if residual is not None:
        y = y + residual
    return y


def _attention(qkv: torch.Tensor, heads: int, fill: List[int], block: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Packed qkv [T, 3*hid] -> packed context [T, hid], one SDPA call for the batch.

    fill empty: one sequence, no mask. Otherwise fill[i] real tokens of block i
    (consecutive sequences, block-diagonal mask), each block `block` long.
    """
    t, three_hid = qkv.size(0), qkv.size(1)
    hid = three_hid // 3
    d = hid // heads
    nb = len(fill)
    if nb == 0:
        qkv5 = qkv.view(1, t, 3, heads, d).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(qkv5[0], qkv5[1], qkv5[2])
        return ctx.transpose(1, 2).reshape(t, hid)
    exact = nb * block == t
    blocks = qkv
    if not exact:
        blocks = qkv.new_zeros(nb * block, three_hid)
        s = 0
        for i in range(nb):
            blocks.narrow(0, i * block, fill[i]).copy_(qkv.narrow(0, s, fill[i]))
            s += fill[i]
    qkv5 = blocks.view(nb, block, 3, heads, d).permute(2, 0, 3, 1, 4)
    ctx = F.scaled_dot_product_attention(qkv5[0], qkv5[1], qkv5[2], attn_mask=mask)  # [blocks, heads, P, d]
    ctx = ctx.transpose(1, 2).reshape(nb * block, hid)
    if exact:
        return ctx
    parts: List[torch.Tensor] = []
    for i in range(nb):
        parts.append(ctx.narrow(0, i * block, fill[i]))
    return torch.cat(parts)


def encode(ids: torch.Tensor, types: torch.Tensor, pos: torch.Tensor, emb: List[torch.Tensor],
           weights: List[torch.Tensor], heads: int, eps: float, gelu_tanh: bool, fused: bool,
           fill: List[int], block: int, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Packed token ids [T] -> last hidden state [T, H] in fp32.

    emb: word, position, token-type tables (the weights' dtype), embedding LayerNorm
    weight and bias (fp32); the embedding sum and its LayerNorm run in fp32.
    weights: 12 per layer, in LayerWeights.tensors() order.
    """
    word = emb[0]
    # index_select, not word[ids]: TorchScript's aten::index re-takes the GIL (measured: one
    # switch interval, 5 ms, per lookup while another thread runs Python).
    x = word.index_select(0, ids).float() + emb[1].index_select(0, pos).float() + emb[2].index_select(0, types).float()
    norm = [x.size(1)]
    x = F.layer_norm(x, norm, emb[3], emb[4], eps).to(word.dtype)
    for i in range(len(weights) // 12):
        o = 12 * i
        qkv = _linear(x, weights[o], weights[o + 1], False, None, fused, gelu_tanh)  # fused QKV: one GEMM
        ctx = _attention(qkv, heads, fill, block, mask)
        h = _linear(ctx, weights[o + 2], weights[o + 3], False, x, fused, gelu_tanh)
        h = F.layer_norm(h, norm, weights[o + 4], weights[o + 5], eps)
        f = _linear(h, weights[o + 6], weights[o + 7], True, None, fused, gelu_tanh)
        x = F.layer_norm(_linear(f, weights[o + 8], weights[o + 9], False, h, fused, gelu_tanh), norm,
                         weights[o + 10], weights[o + 11], eps)
    return x.float()


_SCRIPTED: dict = {}
_SCRIPT_LOCK = threading.Lock()


def script_once(fn):
    """fn compiled by TorchScript, once per process (the decoder embedder's CPU forward uses it too)."""
    with _SCRIPT_LOCK:
        if fn not in _SCRIPTED:
            with warnings.catch_warnings():  # torch.jit is deprecated in favour of torch.compile, which
                warnings.simplefilter("ignore")  # would need a C++ toolchain and minutes of compiling per shape
                _SCRIPTED[fn] = torch.jit.script(fn)
        return _SCRIPTED[fn]


def scripted_encode():
    """encode compiled by TorchScript (once per process)."""
    return script_once(encode)


GIL_SWITCH_S = 0.0001


def shorten_gil_switch() -> None:
    """Lower the interpreter's switch interval (process-wide) to 0.5 ms, if it is longer.

    The compiled forward runs without the GIL, but a batch still takes it a few
    times (packing, the call's entry and exit, pooling). In a server whose event
    loop thread runs Python most of the time, each take waits up to the switch
    interval (default 5 ms): a batch of 30 short queries measured 45 ms in the
    server against 18 ms alone.
    """
    import sys

    if sys.getswitchinterval() > GIL_SWITCH_S:
        sys.setswitchinterval(GIL_SWITCH_S)


def _has_fused_linear(dtype: torch.dtype) -> bool:
    """oneDNN's packed GEMMs for `dtype` on this build and CPU: fp32 wherever oneDNN is; bf16 only
    where oneDNN has a bf16 path (AVX512-BW/VL/DQ, AVX-NE-CONVERT or AMX: on an AVX2-only CPU such
    as AMD Zen 3 the weight reorder raises); fp16 never (it needs AVX512-FP16/AMX-FP16)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    if dtype == torch.bfloat16:
        probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return probe is None or bool(probe())
    return dtype == torch.float32


class CpuEncoder:
    """An encoder's weights prepared for the CPU, and its forward pass over packed batches.

    fused=True (the default where PyTorch is built with oneDNN, for fp32 and
    bf16): every weight is reordered once, at load, into oneDNN's blocked layout
    (AMX/VNNI tiles for bf16) instead of on every call, which is most of a short
    batch's GEMM time; bias + GeLU and bias + residual add run in the GEMM's
    epilogue, so a layer is 4 GEMMs, 2 LayerNorms and the attention call; and the
    layer stack runs as TorchScript, with the GIL released. fused=False: plain
    F.linear, run eagerly (any build, any dtype).
    """

    PACK_HINT = 64  # oneDNN picks the blocked layout for this many rows; any row count runs on it

    def __init__(self, w: EncoderWeights, fused: bool | None = None, bucket: bool = True):
        self.w = w
        self.bucket = bucket  # pad token counts up to buckets (see run)
        self.config = w.config
        if fused is None:  # where oneDNN cannot pack this dtype on this CPU: plain F.linear
            fused = _has_fused_linear(w.word.dtype)
        self.fused = fused
        heads = {lw.heads for lw in w.layers}
        if len(heads) > 1:
            raise ValueError("every layer must have the same number of heads")
        self.heads = heads.pop() if heads else w.config.heads
        pack = (lambda t: torch.ops.mkldnn._reorder_linear_weight(t, self.PACK_HINT)) if fused else (lambda t: t)
        # 12 tensors per layer; the four matrices packed for oneDNN (the originals stay in `w`,
        # which other engine instances share).
        self.flat: list[torch.Tensor] = []
        for lw in w.layers:
            for j, t in enumerate(lw.tensors()):
                self.flat.append(pack(t) if j in (0, 2, 6, 8) else t)
        self.emb = [w.word, w.pos, w.types, w.emb_ln_w.float(), w.emb_ln_b.float()]
        self.encode = scripted_encode() if fused else encode

    def forward(self, ids: torch.Tensor, types: torch.Tensor, pos: torch.Tensor, lengths: np.ndarray) -> torch.Tensor:
        """Last hidden state [T, H] (fp32) of a packed batch (tensors in, tensor out)."""
        return torch.from_numpy(self.run(ids.numpy(), types.numpy(), pos.numpy(), lengths))

    def run(self, ids: np.ndarray, types: np.ndarray, pos: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Last hidden state [T, H] (fp32) of a packed batch (numpy in, numpy out).

        The token count is padded up to a bucket (token_bucket: multiples of 16
        up to 128, then steps of 1/8 of the power of two below), with dummy
        sequences that attend only to themselves: oneDNN builds (JIT-compiles) a
        GEMM primitive per row count, and a server's batches have a new token
        count almost every time, which measured 2x slower than repeated shapes.
        Buckets keep the row counts to a few dozen, all cached after warm-up.
        A single sequence is not padded: it has at most max_length row counts,
        and its unmasked attention is cheaper (measured 5.4 vs 7.4 ms at batch 1).
        The plan and mask are built with numpy, so no torch op runs (and
        re-takes the GIL) outside the one compiled call.
        """
        cfg = self.config
        lengths = np.asarray(lengths, dtype=np.int64)
        t = int(lengths.sum())
        pad = token_bucket(t) - t if self.bucket and len(lengths) > 1 else 0
        if pad:
            chunk = max(BIN_TOKENS, int(lengths.max()))
            extra = [chunk] * (pad // chunk) + ([pad % chunk] if pad % chunk else [])
            lengths = np.concatenate([lengths, np.array(extra, dtype=np.int64)])
            z = np.zeros(pad, dtype=np.int64)
            ids, types, pos = (np.concatenate([np.asarray(a, dtype=np.int64), z]) for a in (ids, types, pos))
        if not cfg.type_vocab:
            types = np.zeros_like(ids)
        plan = AttentionPlan(lengths)
        fill, block, mask = ([], 0, None) if plan.single else (plan.fill, plan.block, plan.mask)
        tt = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
        with torch.inference_mode():
            out = self.encode(tt(ids), tt(types), tt(pos), self.emb, self.flat, self.heads, float(cfg.eps),
                              cfg.activation == "gelu_tanh", self.fused, fill, block, mask)
        return out.numpy()[:t]


def token_bucket(t: int) -> int:
    """Round a token count up: multiples of 16 up to 128, then steps of 1/8 of the power of two below."""
    if t <= 128:
        return max(16, (t + 15) // 16 * 16)
    step = 1 << (t.bit_length() - 4)
    return (t + step - 1) // step * step


def forward(w: EncoderWeights, ids: torch.Tensor, types: torch.Tensor, pos: torch.Tensor,
            lengths: np.ndarray) -> torch.Tensor:
    """One-off forward without prepared weights (plain F.linear, eager); engines keep a CpuEncoder."""
    return CpuEncoder(w, fused=False).forward(ids, types, pos, lengths)

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

With `invariant` (the torch engine's batch_invariant, its default) a token's
result depends on its own sequence only, bit for bit, whatever shares the
batch: see InvariantPlan.
"""

from __future__ import annotations

import threading
import warnings
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from surge.engines.encoder_weights import EncoderWeights
from surge.engines.row_bound import ROW_CHUNK, probe_bound

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


ATTN_ROUND = 16  # invariant form: a sequence's attention block is its length rounded up to this


class InvariantPlan:
    """The batch-invariant layout of a packed batch: what a token computes depends on its own sequence only.

    Measured on oneDNN (torch 2.13, Sapphire Rapids, 1-2 threads): a GEMM row's bits never depend on
    the other rows' values, nor on its place in a call of fixed row count M. Across M: packed fp32 GEMMs
    give the same bits for every M >= 2; packed bf16 ones with K=384 too, but with K=1536 (FFN down)
    only while M stays at most ~144 (beyond, AMX and its tail kernels sum K in other orders, and a
    row's bits follow M and its place in the call); F.linear in fp32 has three families (M=1, 2-15,
    16+). So the batch is padded to a multiple of ROW_CHUNK rows (never one row), and each GEMM runs
    in calls of at most the row count that CpuEncoder's load-time probe (row_count_bound) finds safe
    on this CPU: one call for the batch where any count is. The flash attention kernel's bits depend
    on the key length and (bf16) on a sequence's offset in a shared block: so every sequence gets a
    block of its own, at offset 0, ceil(n / ATTN_ROUND) * ATTN_ROUND long (a function of n alone), its
    padded keys masked; sequences with the same block size share one call. LayerNorm, GeLU, residuals
    and the embedding sum are per row already.

    tokens: rows of the padded batch (a multiple of ROW_CHUNK). blocks: per group, the block size P;
    gathers: per group, [blocks * P] rows of the packed qkv (index `tokens` is a zero row, the padding);
    masks: per group, [blocks, 1, 1, P] (True = a real key), with `causal` [blocks, 1, P, P] (a query also
    never sees its sequence's later keys: a decoder's); back: [tokens] the row of the groups' concatenated
    outputs that holds each token (padding rows read row 0: their values are never used).
    """

    def __init__(self, lengths: np.ndarray, chunk: int = ROW_CHUNK, round_to: int = ATTN_ROUND,
                 causal: bool = False):
        lengths = np.asarray(lengths, dtype=np.int64)
        t = int(lengths.sum())
        self.tokens = max(chunk, -(-t // chunk) * chunk)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        sizes = -(-lengths // round_to) * round_to
        self.blocks: list[int] = []
        self.gathers: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        back = np.zeros(self.tokens, dtype=np.int64)
        base = 0
        for p in np.unique(sizes).tolist():
            seqs = np.flatnonzero(sizes == p)
            pos = np.arange(p)
            real = pos[None, :] < lengths[seqs, None]  # [blocks, P]
            gather = np.where(real, starts[seqs, None] + pos[None, :], self.tokens)
            for j, i in enumerate(seqs.tolist()):
                back[starts[i]:starts[i] + lengths[i]] = base + j * p + np.arange(lengths[i])
            base += len(seqs) * p
            self.blocks.append(int(p))
            self.gathers.append(torch.from_numpy(np.ascontiguousarray(gather.reshape(-1))))
            mask = real[:, None, None, :] & np.tri(p, dtype=bool) if causal else real[:, None, None, :]
            self.masks.append(torch.from_numpy(np.ascontiguousarray(mask)))
        self.back = torch.from_numpy(back)

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


def _linear_rows(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, gelu: bool, residual: Optional[torch.Tensor],
                 fused: bool, gelu_tanh: bool, chunk: int) -> torch.Tensor:
    """_linear in calls of at most `chunk` rows (the rows in order); chunk 0: one call."""
    t = x.size(0)
    if chunk == 0 or t <= chunk:
        return _linear(x, w, b, gelu, residual, fused, gelu_tanh)
    parts: List[torch.Tensor] = []
    for s in range(0, t, chunk):
        m = min(chunk, t - s)
        r: Optional[torch.Tensor] = None
        if residual is not None:
            r = residual.narrow(0, s, m)
        parts.append(_linear(x.narrow(0, s, m), w, b, gelu, r, fused, gelu_tanh))
    return torch.cat(parts)


def _attention_invariant(qkv: torch.Tensor, heads: int, blocks: List[int], gathers: List[torch.Tensor],
                         masks: List[torch.Tensor], back: torch.Tensor) -> torch.Tensor:
    """Packed qkv [T, 3*hid] -> packed context [T, hid]: each sequence in its own block (InvariantPlan)."""
    three_hid = qkv.size(1)
    hid = three_hid // 3
    d = hid // heads
    padded = torch.cat([qkv, qkv.new_zeros(1, three_hid)])  # row T: the blocks' padding
    outs: List[torch.Tensor] = []
    for g in range(len(blocks)):
        p = blocks[g]
        nb = gathers[g].size(0) // p
        qkv5 = padded.index_select(0, gathers[g]).view(nb, p, 3, heads, d).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(qkv5[0], qkv5[1], qkv5[2], attn_mask=masks[g])
        outs.append(ctx.transpose(1, 2).reshape(nb * p, hid))
    return torch.cat(outs).index_select(0, back)


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
           fill: List[int], block: int, mask: Optional[torch.Tensor], chunks: List[int], blocks: List[int],
           gathers: List[torch.Tensor], masks: List[torch.Tensor], back: torch.Tensor) -> torch.Tensor:
    """Packed token ids [T] -> last hidden state [T, H] in fp32.

    blocks empty: the batch's own attention layout (fill, block, mask: AttentionPlan). Otherwise the
    batch-invariant one (InvariantPlan: blocks, gathers, masks, back). chunks: per GEMM of a layer (QKV,
    output, FFN up, FFN down), > 0: it runs on chunks of that many rows; 0 or absent: one call for the batch.

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
    ck = chunks if len(chunks) == 4 else [0, 0, 0, 0]
    for i in range(len(weights) // 12):
        o = 12 * i
        qkv = _linear_rows(x, weights[o], weights[o + 1], False, None, fused, gelu_tanh, ck[0])  # fused QKV
        if len(blocks) > 0:
            ctx = _attention_invariant(qkv, heads, blocks, gathers, masks, back)
        else:
            ctx = _attention(qkv, heads, fill, block, mask)
        h = _linear_rows(ctx, weights[o + 2], weights[o + 3], False, x, fused, gelu_tanh, ck[1])
        h = F.layer_norm(h, norm, weights[o + 4], weights[o + 5], eps)
        f = _linear_rows(h, weights[o + 6], weights[o + 7], True, None, fused, gelu_tanh, ck[2])
        x = F.layer_norm(_linear_rows(f, weights[o + 8], weights[o + 9], False, h, fused, gelu_tanh, ck[3]), norm,
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
    F.linear, run eagerly (any build, any dtype). invariant=True: the batch-invariant layout
    (InvariantPlan), for either form; a token's result is then bit for bit the same in any batch.
    """

    PACK_HINT = 64  # oneDNN picks the blocked layout for this many rows; any row count runs on it

    def __init__(self, w: EncoderWeights, fused: bool | None = None, bucket: bool = True, invariant: bool = False):
        self.w = w
        self.invariant = invariant
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
        # The invariant form's layout (InvariantPlan): rows padded to whole row_chunks; each GEMM in calls
        # of at most gemm_chunks[j] rows (0: one call), as the CPU's kernels allow (row_count_bound).
        self.row_chunk, self.attn_round = ROW_CHUNK, ATTN_ROUND
        self.gemm_chunks = [0, 0, 0, 0]
        if invariant and not fused:
            # F.linear: every call exactly ROW_CHUNK rows (the batch is padded to whole chunks), which keeps a row's
            # bits by construction. The probe is not trusted here: at 1 thread in bf16 it accepted 64-row calls
            # and 36 of 82 sentences then moved with their batch.
            self.gemm_chunks = [ROW_CHUNK] * 4
        elif invariant and w.layers:
            self.gemm_chunks = self.row_count_bound()

    def row_count_bound(self) -> list[int]:
        """Per GEMM of a layer (QKV, output, FFN up, FFN down, with their epilogues): the largest row count
        per call under which its rows come out bit for bit the same whatever the call (row_bound.probe_bound),
        on this CPU, build and thread count. Measured (torch 2.13, Sapphire Rapids, 1-2 threads): fp32 none
        for all four; bf16 none but for FFN down (K=1536), 128. Shapes and kernels are the same in every
        layer: layer 0 answers for all."""
        dt, tanh = self.w.word.dtype, self.config.activation == "gelu_tanh"
        out = []
        for j, gelu, res in ((0, False, False), (2, False, True), (6, True, False), (8, False, True)):
            w, b = self.flat[j], self.flat[j + 1]
            n, k = self.w.layers[0].tensors()[j].shape
            key = ("encoder", tuple(w.shape), k, n, dt, self.fused, gelu, res, tanh, torch.get_num_threads())
            out.append(probe_bound(lambda x, r, w=w, b=b, gelu=gelu: _linear(x, w, b, gelu, r, self.fused, tanh),
                                   k, n, dt, res, key))
        return out

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
        With `invariant` neither applies: the batch is padded to whole ROW_CHUNKs
        only, and a lone sequence takes the same path as any other (InvariantPlan).
        The plan and mask are built with numpy, so no torch op runs (and
        re-takes the GIL) outside the one compiled call.
        """
        cfg = self.config
        lengths = np.asarray(lengths, dtype=np.int64)
        t = int(lengths.sum())
        if self.invariant:
            return self._run_invariant(ids, types, pos, lengths, t)
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
                              cfg.activation == "gelu_tanh", self.fused, fill, block, mask, [], [], [], [],
                              _NO_INDEX)
        return out.numpy()[:t]

    def _run_invariant(self, ids, types, pos, lengths: np.ndarray, t: int) -> np.ndarray:
        """run's batch-invariant form: padded to whole ROW_CHUNKs, each sequence in its own attention block."""
        cfg = self.config
        plan = InvariantPlan(lengths, self.row_chunk, self.attn_round)
        pad = plan.tokens - t  # padding rows: token 0 at position 0; attended by nothing, never returned

        def tt(a) -> torch.Tensor:
            a = np.asarray(a, dtype=np.int64)
            return torch.from_numpy(np.concatenate([a, np.zeros(pad, dtype=np.int64)]) if pad else a)

        if not cfg.type_vocab:
            types = np.zeros_like(ids)
        with torch.inference_mode():
            out = self.encode(tt(ids), tt(types), tt(pos), self.emb, self.flat, self.heads, float(cfg.eps),
                              cfg.activation == "gelu_tanh", self.fused, [], 0, None, self.gemm_chunks, plan.blocks,
                              plan.gathers, plan.masks, plan.back)
        return out.numpy()[:t]


_NO_INDEX = torch.zeros(0, dtype=torch.int64)


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

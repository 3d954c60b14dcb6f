"""One tensor-parallel rank's CPU forward in the batch-invariant form (the torch engine's, encoder_cpu).

A shard runs the single-process CPU engine's invariant pieces on its heads and FFN columns: the batch
padded to whole ROW_CHUNKs, each GEMM in calls of at most the row count that row_bound's load-time probe
finds safe for that GEMM on this CPU, and each sequence in an attention block of its own (InvariantPlan).
So a row of the rank's partial products depends on its own sequence only, and so does the sum across ranks
as long as `reduce` keeps a row's bits (tensor_parallel.Groups.sum_in_rank_order).

The out-projection and FFN-out GEMMs give partial sums: no bias and no residual in their epilogue (both are
added once, after the reduce, in layer_reference's order), so they are probed in that form.
Eager Python rather than encoder_cpu's TorchScript: the reduce is a Python call into the process group.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from surge.engines import encoder_cpu as cpu
from surge.engines.encoder import Reduce
from surge.engines.encoder_weights import EncoderWeights
from surge.engines.row_bound import ROW_CHUNK, probe_bound

# per GEMM of a layer: (index in LayerWeights.tensors(), GeLU in the epilogue, bias in the epilogue)
_GEMMS = ((0, False, True), (2, False, False), (6, True, True), (8, False, False))


class ShardCpuEncoder:
    """A rank's shard prepared for the CPU (weights packed for oneDNN where it can, as CpuEncoder), run in the
    batch-invariant form with a `reduce` after each partial GEMM."""

    def __init__(self, w: EncoderWeights, fused: bool | None = None):
        self.w, self.config = w, w.config
        self.fused = cpu._has_fused_linear(w.word.dtype) if fused is None else fused
        heads = {lw.heads for lw in w.layers}
        if len(heads) > 1:
            raise ValueError("every layer must have the same number of heads")
        self.heads = heads.pop() if heads else w.config.heads
        pack = (lambda t: torch.ops.mkldnn._reorder_linear_weight(t, cpu.CpuEncoder.PACK_HINT)) if self.fused \
            else (lambda t: t)
        self.layers = [[pack(t) if j in (0, 2, 6, 8) else t for j, t in enumerate(lw.tensors())] for lw in w.layers]
        self.emb = [w.word, w.pos, w.types, w.emb_ln_w.float(), w.emb_ln_b.float()]
        self.tanh = self.config.activation == "gelu_tanh"
        # F.linear: calls of exactly ROW_CHUNK rows, as CpuEncoder does (its probe was shown wrong there)
        self.gemm_chunks = [ROW_CHUNK] * 4
        if self.fused and w.layers:
            self.gemm_chunks = self.row_count_bound()

    def row_count_bound(self) -> list[int]:
        """Per GEMM of a layer, in the form the shard calls it: row_bound.probe_bound's largest safe row count."""
        dt, out = self.w.word.dtype, []
        for j, gelu, has_bias in _GEMMS:
            w, b = self.layers[0][j], self.layers[0][j + 1] if has_bias else None
            n, k = self.w.layers[0].tensors()[j].shape
            key = ("tp-shard", n, k, dt, self.fused, gelu, has_bias, self.tanh, torch.get_num_threads())

            def call(x, r, w=w, b=b, gelu=gelu):  # r: no residual in a shard's GEMMs
                return cpu._linear(x, w, b, gelu, None, self.fused, self.tanh)

            out.append(probe_bound(call, k, n, dt, False, key))
        return out

    def run(self, ids, types, pos, lengths, reduce: Reduce) -> np.ndarray:
        """Last hidden state [T, H] (fp32) of a packed batch; every rank calls it with the same batch."""
        cfg = self.config
        lengths = np.asarray(lengths, dtype=np.int64)
        t = int(lengths.sum())
        plan = cpu.InvariantPlan(lengths, ROW_CHUNK, cpu.ATTN_ROUND)
        pad = plan.tokens - t  # padding rows: token 0 at position 0, attended by nothing, never returned

        def tt(a) -> torch.Tensor:
            a = np.asarray(a, dtype=np.int64)
            return torch.from_numpy(np.concatenate([a, np.zeros(pad, dtype=np.int64)]) if pad else a)

        if not cfg.type_vocab:
            types = np.zeros_like(ids)
        red = reduce or (lambda x: x)
        ck, fused, tanh, norm = self.gemm_chunks, self.fused, self.tanh, (cfg.hidden,)
        with torch.inference_mode():
            word = self.emb[0]
            x = (word.index_select(0, tt(ids)).float() + self.emb[1].index_select(0, tt(pos)).float()
                 + self.emb[2].index_select(0, tt(types)).float())
            x = F.layer_norm(x, norm, self.emb[3], self.emb[4], cfg.eps).to(word.dtype)
            for wqkv, bqkv, wo, bo, ln1_w, ln1_b, w1, b1, w2, b2, ln2_w, ln2_b in self.layers:
                qkv = cpu._linear_rows(x, wqkv, bqkv, False, None, fused, tanh, ck[0])
                ctx = cpu._attention_invariant(qkv, self.heads, plan.blocks, plan.gathers, plan.masks, plan.back)
                a = red(cpu._linear_rows(ctx, wo, None, False, None, fused, tanh, ck[1]))
                h = F.layer_norm(x + a + bo, norm, ln1_w, ln1_b, cfg.eps)
                f = cpu._linear_rows(h, w1, b1, True, None, fused, tanh, ck[2])
                x = F.layer_norm(h + red(cpu._linear_rows(f, w2, None, False, None, fused, tanh, ck[3])) + b2, norm,
                                 ln2_w, ln2_b, cfg.eps)
            return x.float().numpy()[:t]

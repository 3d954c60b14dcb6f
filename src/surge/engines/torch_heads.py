"""Pooling and task heads inside the torch engine's captured graph (CUDA only): only the pooled rows, or
the heads' logits, are copied back to the host instead of every token's hidden state.

A mixin of TorchEngine (engines/torch_gpu.py), apart from it because what the graph ends in is a choice
made once after load (attach_pooling, attach_heads); the encoder itself is the same. Needs the
engine's `device`, `weights`, `offload`, `plan`, `config`, `batch_invariant`, `head_set`,
`_graphs`, `_slots`, `_slices`, `_lock`, `_inputs`, `on_device`, `_oom` and `_run_cuda`; run_hidden (the
unpooled run where the graphs pool) also `pool_mode`, `stream`, `workspace`, `_shared_ws`, `gemm`, `dtype`,
`bucket`, `modes`, `_views`, `_h_inputs`, `_h_out`, `_hidden_lock`, `_hidden_bufs`, `run`, `_stage_inputs` and
`_inputs_view`.
"""

from __future__ import annotations

import numpy as np
import torch

from surge.engines.encoder import forward_fused
from surge.types import Layout, TokenBatch


class GraphHeads:
    def attach_pooling(self, mode: str) -> bool:
        """Pool inside the captured graph (engines/device_pool.py): run() then returns [batch, hidden]
        float32 rows, and only those are copied back. CUDA only, mean / cls / last, before warm-up
        (the graphs are rebuilt). False: the caller pools the hidden states on the host."""
        from surge.engines.device_pool import DEVICE_POOLING

        if (self.device.type != "cuda" or self.head_set is not None or self.offload is not None
                or mode not in DEVICE_POOLING or self.weights is None):
            return False
        with self._lock:
            self._graphs.clear()
            self.pool_mode = mode
            self._h_pooled = torch.empty((self.plan.batch, self.config.hidden), dtype=torch.float32,
                                         pin_memory=True)
            self._slots = None  # rebuilt with a pooled-rows buffer per slot
            self._slices.clear()
        return True

    def attach_heads(self, head_set) -> bool:
        """Compute `head_set`'s classification / token heads inside the captured graph (CUDA only).

        The graph then ends in the heads' logits (fp32): [batch, fixed] for sequence heads,
        [tokens, widths] for token heads, and only those are copied back, not the hidden
        states. Embedding heads (pooling) stay on the host path: returns False then."""
        from surge.engines.heads import POOLED, SEQUENCE

        if self.device.type != "cuda" or any(h.kind == POOLED for h in head_set.heads):
            return False
        dev = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).to(self.device)  # noqa: E731
        heads = []
        for h in head_set.heads:
            pre = [(dev(w), dev(b), act) for w, b, act in h.pre]
            heads.append((h.kind == SEQUENCE, pre, dev(h.weight), dev(h.bias)))
        with self._lock:
            self._graphs.clear()
            self._dev_heads = heads
            self.head_set = head_set
            self._fixed = head_set.fixed
            self._tok_width = sum(head_set.token_widths)
            n = self.plan.batch * self._fixed + self.plan.tokens * self._tok_width
            self._h_heads = torch.empty(n, dtype=torch.float32, pin_memory=True)
            self._slots = None  # rebuilt with a heads buffer per slot
            self._slices.clear()
        return True

    def _heads_forward(self, x: torch.Tensor, inputs: torch.Tensor, key) -> torch.Tensor:
        bb, tb, _ = key
        cu = inputs[3 * tb:3 * tb + bb + 1].long()
        cls = x.index_select(0, cu[:-1].clamp(max=tb - 1)).float()  # padded batch rows read a real row
        fixed, tokens = [], []
        xf = None
        affine = self._head_affine
        for seq, pre, w, b in self._dev_heads:
            if seq:
                h = cls
                for pw, pb, act in pre:
                    h = affine(pb, h, pw)
                    h = torch.tanh(h) if act == "tanh" else torch.relu(h)
                fixed.append(affine(b, h, w))
            else:
                xf = x.float() if xf is None else xf
                tokens.append(affine(b, xf, w))
        parts = [torch.cat(fixed, 1).reshape(-1)] if fixed else []
        if tokens:
            parts.append(torch.cat(tokens, 1).reshape(-1))
        return torch.cat(parts)

    def _head_affine(self, bias: torch.Tensor, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """h @ w^T + bias in FP32; with batch invariance on the one-tiling GEMM (cuBLAS picks its
        kernel by the batch's rows, and a query's logits would round with its batch-mates)."""
        if not self.batch_invariant:
            return torch.addmm(bias, h, w.t())
        from surge.engines.kernels.gemm import linear_invariant

        out = torch.empty((h.shape[0], w.shape[0]), dtype=torch.float32, device=h.device)
        return linear_invariant(h, w, bias, out)

    def run_heads(self, batch: TokenBatch) -> np.ndarray:
        """The attached heads' rows for a batch (HeadSet.rows layout), heads computed on the GPU."""
        ids, types, pos, lengths = self._inputs(batch)
        try:
            with self.on_device():
                fixed, tokens = self._run_cuda(ids, types, pos, lengths, heads=True)
        except torch.cuda.OutOfMemoryError as exc:
            raise self._oom(lengths) from exc
        return self.head_set.rows(fixed, tokens, lengths)

    def run_hidden(self, batch: TokenBatch) -> np.ndarray:
        """Every token's last hidden state, also where the graphs pool (attach_pooling): TEI's /embed_all.
        As run() returns it without pooling: [T, hidden] packed, [B, L, hidden] padded.

        The same fused forward, run eagerly (no graph is captured for a route this rare) on this
        instance's stream under its lock, with staging buffers of its own, one such run at a time: it
        never takes a pipeline slot, which the batcher's launch, on its event loop, counts on finding."""
        if self.pool_mode is None or self.device.type != "cuda":
            return self.run(batch)
        ids, types, pos, lengths = self._inputs(batch)
        try:
            with self.on_device(), self._hidden_lock:
                packed = self._hidden_cuda(ids, types, pos, lengths)
        except torch.cuda.OutOfMemoryError as exc:
            raise self._oom(lengths) from exc
        if batch.layout is Layout.PACKED:
            return packed
        out = np.zeros(batch.input_ids.shape + (packed.shape[1],), dtype=packed.dtype)
        out[batch.attention_mask.astype(bool)] = packed
        return out

    def _hidden_cuda(self, ids, types, pos, lengths) -> np.ndarray:
        if self._hidden_bufs is None:
            self._hidden_bufs = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                                      for t in (self._h_inputs, self._h_out)) + (torch.cuda.Event(),)
        h_in, h_out_all, done = self._hidden_bufs
        t = len(ids)
        key = self.bucket(len(lengths), t, int(lengths.max()))
        bb, tb, lb = key
        n = self._stage_inputs(ids, types, pos, lengths, key, h_in)
        with self._lock:
            self.workspace.lock.acquire()
            try:
                modes = self.modes(key)
                views = self._views(key)
                with torch.cuda.stream(self.stream):
                    self._inputs_view(n).copy_(h_in[:n], non_blocking=True)
                    x = forward_fused(self.weights, views["inputs"], tb, bb, lb, views,
                                      gemm=self.gemm if self.gemm in modes else modes[0], offload=self.offload)
                    h_out = h_out_all[:t]
                    h_out.copy_(x[:t].view(h_out.dtype), non_blocking=True)
                    done.record(self.stream)
                if self._shared_ws is not None:  # other instances' streams use the workspace next
                    done.synchronize()
            finally:
                self.workspace.lock.release()
        done.synchronize()
        res = h_out.numpy().copy()
        if self.dtype == torch.bfloat16:
            res = (res.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return res

"""Activation memory: a lifetime-based plan and one preallocated workspace.

The fused encoder (encoder.py) runs a layer as

    qkv  = x @ Wqkv + b            (lives until attention is done)
    ctx  = attention(qkv)          (lives until the out-projection)
    tmp  = ctx @ Wo                (lives until LayerNorm writes x)
    x    = LN(tmp + bo + x)
    ffn  = gelu(x @ W1 + b1)       (qkv is dead: ffn reuses its bytes)
    tmp  = ffn @ W2
    x    = LN(tmp + b2 + x)

so four regions hold every activation of every layer: x [T,H], big
[T,max(3*hid,ffn)] (qkv, then ffn), ctx [T,hid] and tmp [T,H]. The plan is
sized for the largest token bucket, allocated once, and every CUDA graph
captures views into it. Several models whose runs are serialized can share
one `Workspace` (its lock serializes them).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from surge.engines.encoder_weights import EncoderConfig

_ALIGN = 256  # bytes: keeps every region aligned for vector loads and cuBLAS


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Region:
    name: str
    offset: int  # bytes
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.tensor([], dtype=self.dtype).element_size()


@dataclass(frozen=True)
class WorkspacePlan:
    tokens: int
    batch: int
    regions: tuple[Region, ...]

    @property
    def nbytes(self) -> int:
        return max((_align(r.offset + r.nbytes) for r in self.regions), default=0)

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)


def plan_workspace(cfg: EncoderConfig, tokens: int, batch: int, dtype: torch.dtype,
                   heads: int | None = None, ffn: int | None = None) -> WorkspacePlan:
    """Regions for `tokens` packed tokens of `batch` sequences (heads/ffn: this shard's, for TP)."""
    heads = cfg.heads if heads is None else heads
    ffn = cfg.intermediate if ffn is None else ffn
    hid = heads * cfg.head_dim
    shapes = [("x", (tokens, cfg.hidden), dtype), ("big", (tokens, max(3 * hid, ffn)), dtype),
              ("ctx", (tokens, hid), dtype), ("tmp", (tokens, cfg.hidden), dtype),
              # ids | types | positions | cu_seqlens, one int32 block so one copy feeds a run
              ("inputs", (3 * tokens + batch + 1,), torch.int32)]
    regions, off = [], 0
    for name, shape, dt in shapes:
        r = Region(name, off, shape, dt)
        regions.append(r)
        off = _align(off + r.nbytes)
    return WorkspacePlan(tokens, batch, tuple(regions))


def naive_activation_bytes(cfg: EncoderConfig, batch: int, seq: int, dtype_bytes: int) -> int:
    """Every activation of an unfused, padded forward held in its own buffer (HF eager-style).

    Per layer: q, k, v, scores and probabilities [B,h,S,S], context, out-proj,
    residual sum, LN output, FFN in, GeLU out, FFN out, residual sum, LN output.
    """
    t = batch * seq
    h, f = cfg.hidden, cfg.intermediate
    per_layer = t * (3 * h + h + h + h + h + f + f + h + h + h) + 2 * batch * cfg.heads * seq * seq
    return dtype_bytes * (cfg.layers * per_layer + 2 * t * h)  # + embeddings sum and LN


class Workspace:
    """One flat device buffer; views into it for a plan. Shareable among engines.

    `grow` only ever enlarges it (a model needing more than the current size);
    engines capture CUDA graphs on views, so they re-capture after a grow
    (`generation` tells them).
    """

    def __init__(self, device: torch.device | str, nbytes: int = 0):
        self.device = torch.device(device)
        self.lock = threading.RLock()
        self.generation = 0
        self._buf = torch.empty(max(nbytes, _ALIGN), dtype=torch.uint8, device=self.device)

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    def grow(self, nbytes: int) -> bool:
        with self.lock:
            if nbytes <= self._buf.numel():
                return False
            self._buf = None  # free first: peak memory stays at the new size
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.generation += 1
            return True

    def view(self, region: Region, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        shape = region.shape if shape is None else shape
        n = 1
        for s in shape:
            n *= s
        size = torch.tensor([], dtype=region.dtype).element_size()
        return self._buf[region.offset: region.offset + n * size].view(region.dtype).view(shape)

    def views(self, plan: WorkspacePlan, tokens: int, batch: int) -> dict[str, torch.Tensor]:
        """Views for a run of `tokens`/`batch` (<= the plan's) at the plan's fixed offsets."""
        out = {}
        for r in plan.regions:
            if r.name == "inputs":
                out[r.name] = self.view(r, (3 * tokens + batch + 1,))
            else:
                out[r.name] = self.view(r, (tokens,) + r.shape[1:])
        return out

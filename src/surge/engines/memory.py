"""Activation memory: a lifetime-based plan and one preallocated workspace.

The fused encoder (encoder.py) runs a layer as

    qkv  = x @ Wqkv + b            [T, 3*hid]
    ctx  = attention(qkv)          written over Q's columns of qkv (each attention
                                   program reads its Q block before writing those rows)
    for each chunk c of <= CHUNK tokens:
        tmp  = ctx[c] @ Wo         [C, H]
        x[c] = LN(tmp + bo + x[c])
    for each chunk c:               (qkv is dead: ffn reuses its bytes)
        ffn  = gelu(x[c] @ W1 + b1)  [C, ffn]
        tmp  = ffn @ W2
        x[c] = LN(tmp + b2 + x[c])

so three regions hold every activation of every layer: x [T,H], big
max(T*3*hid, C*ffn) elements, and tmp [C,H]; the [T, ffn] intermediate, the
largest tensor of an unchunked layer, never exists. The plan is sized for
the largest token bucket, allocated once, and every CUDA graph captures views
into it. Several models whose runs are serialized can share one `Workspace`
(its lock serializes them).
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


CHUNK = 8192  # tokens per FFN/out-projection chunk: GEMMs stay at full speed, and batches up to
# 8192 tokens run unchunked (chunking 4608 tokens as 4096 + 512 cost 10% on the H200)


def plan_workspace(cfg: EncoderConfig, tokens: int, batch: int, dtype: torch.dtype,
                   heads: int | None = None, ffn: int | None = None) -> WorkspacePlan:
    """Regions for `tokens` packed tokens of `batch` sequences (heads/ffn: this shard's, for TP)."""
    heads = cfg.heads if heads is None else heads
    ffn = cfg.intermediate if ffn is None else ffn
    hid = heads * cfg.head_dim
    chunk = min(tokens, CHUNK)
    shapes = [("x", (tokens, cfg.hidden), dtype), ("big", (max(tokens * 3 * hid, chunk * ffn),), dtype),
              ("tmp", (chunk, cfg.hidden), dtype),
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

    def views(self, plan: WorkspacePlan, tokens: int, batch: int, hid: int, ffn: int) -> dict[str, torch.Tensor]:
        """Views for a run of `tokens`/`batch` (<= the plan's) at the plan's fixed offsets."""
        chunk = min(tokens, CHUNK)
        big = plan.region("big")
        return {
            "x": self.view(plan.region("x"), (tokens, plan.region("x").shape[1])),
            "qkv": self.view(big, (tokens, 3 * hid)),
            "ffn": self.view(big, (chunk, ffn)),
            "tmp": self.view(plan.region("tmp"), (chunk, plan.region("tmp").shape[1])),
            "inputs": self.view(plan.region("inputs"), (3 * tokens + batch + 1,)),
        }


# ---------------------------------------------------------------- weight offload

class _Packed:
    """A layer's tensors laid out back to back in one byte buffer (one copy moves a layer)."""

    def __init__(self, lw):
        self.heads = lw.heads
        self.specs, off = [], 0
        for t in lw.tensors():
            self.specs.append((off, tuple(t.shape), t.dtype))
            off = _align(off + t.numel() * t.element_size())
        self.nbytes = off

    def fill(self, buf: torch.Tensor, lw) -> None:
        for (off, shape, dt), t in zip(self.specs, lw.tensors()):
            n = t.numel() * t.element_size()
            buf[off:off + n].copy_(t.contiguous().view(-1).view(torch.uint8))

    def views(self, buf: torch.Tensor):
        from surge.engines.encoder_weights import LayerWeights

        ts = []
        for off, shape, dt in self.specs:
            n = 1
            for s in shape:
                n *= s
            ts.append(buf[off:off + n * torch.tensor([], dtype=dt).element_size()].view(dt).view(shape))
        return LayerWeights(*ts, heads=self.heads)


class OffloadedLayers:
    """Layers beyond a GPU memory budget live in pinned host memory and stream in.

    The first `resident` layers stay on the GPU. The others are copied, one
    layer per copy, on a side stream into two GPU slots (double buffering):
    while layer j computes from slot j%2, layer j+1 is already in the other
    slot or on its way, and layer j+2's copy starts as soon as layer j's
    kernels are done with the slot (an event on the compute stream). Copies
    and compute overlap; a run costs about max(copy time, compute time).
    """

    def __init__(self, layers: list, resident: int, device: torch.device):
        self.device = torch.device(device)
        self.n = len(layers)
        self.resident = [self._to_gpu(lw) for lw in layers[:resident]]
        off = layers[resident:]
        self.packed = _Packed(off[0]) if off else None
        self.host = []
        for lw in off:
            buf = torch.empty(self.packed.nbytes, dtype=torch.uint8, pin_memory=True)
            self.packed.fill(buf, lw)
            self.host.append(buf)
        nslots = min(2, len(off))
        self.slots = [torch.empty(self.packed.nbytes, dtype=torch.uint8, device=self.device) for _ in range(nslots)]
        self.slot_views = [self.packed.views(s) for s in self.slots]
        self.copy_stream = torch.cuda.Stream(self.device)
        self.loaded = [torch.cuda.Event() for _ in self.slots]
        self.freed = [torch.cuda.Event() for _ in self.slots]

    def _to_gpu(self, lw):
        from surge.engines.encoder_weights import LayerWeights

        return LayerWeights(*[t.to(self.device) for t in lw.tensors()], heads=lw.heads)

    @property
    def gpu_bytes(self) -> int:
        return sum(l.nbytes() for l in self.resident) + sum(s.numel() for s in self.slots)

    @property
    def host_bytes(self) -> int:
        return sum(h.numel() for h in self.host)

    def _prefetch(self, j: int, stream: torch.cuda.Stream) -> None:
        slot = j % len(self.slots)
        self.copy_stream.wait_event(self.freed[slot])  # the slot's previous layer is done
        with torch.cuda.stream(self.copy_stream):
            self.slots[slot].copy_(self.host[j], non_blocking=True)
            self.loaded[slot].record(self.copy_stream)

    def begin(self, stream: torch.cuda.Stream) -> None:
        """Start the first copies (call on the compute stream before the embedding)."""
        for e in self.freed:
            e.record(stream)  # slots are free once everything before this run is done
        for j in range(min(len(self.slots), len(self.host))):
            self._prefetch(j, stream)

    def get(self, i: int, stream: torch.cuda.Stream):
        if i < len(self.resident):
            return self.resident[i]
        j = i - len(self.resident)
        slot = j % len(self.slots)
        stream.wait_event(self.loaded[slot])
        return self.slot_views[slot]

    def done(self, i: int, stream: torch.cuda.Stream) -> None:
        if i < len(self.resident):
            return
        j = i - len(self.resident)
        slot = j % len(self.slots)
        self.freed[slot].record(stream)
        if j + len(self.slots) < len(self.host):
            self._prefetch(j + len(self.slots), stream)


def resident_layers(layer_bytes: int, n_layers: int, embed_bytes: int, budget: int) -> int:
    """How many layers stay on the GPU under a weight budget (two slots reserved for streaming)."""
    if embed_bytes + n_layers * layer_bytes <= budget:
        return n_layers
    left = budget - embed_bytes - 2 * layer_bytes
    if left < 0:
        from surge.errors import EngineError

        raise EngineError(f"a weight budget of {budget / 2**20:.0f} MiB cannot hold the embeddings "
                          f"({embed_bytes / 2**20:.0f} MiB) and two streaming slots ({2 * layer_bytes / 2**20:.0f} MiB)")
    return min(n_layers, left // layer_bytes)


# ---------------------------------------------------------------- the plan, as `surge inspect memory` shows it

CONTEXT_BYTES_ESTIMATE = 512 * 2**20  # CUDA context + kernels; not allocated by surge (measured: docs/benchmarks/gpu.md)
# cuBLAS's workspace for the engine's stream (PyTorch gives it 32 MiB on Hopper); the
# H200 measurement (tests/gpu/test_gpu_memory_cuda.py) saw 38-40 MiB beyond weights + workspace.
LIBRARY_BYTES = 32 * 2**20


def memory_report(cfg: EncoderConfig, batch: int, seq: int, dtype: torch.dtype,
                  weight_budget: int | None = None) -> dict[str, int]:
    """Bytes by category for serving `batch` x `seq` tokens, with the naive (no reuse) activation sum."""
    size = torch.tensor([], dtype=dtype).element_size()
    embed = size * (cfg.vocab + cfg.max_positions + max(cfg.type_vocab, 1) + 2) * cfg.hidden
    layer = size * (4 * cfg.hidden * cfg.hidden + 2 * cfg.hidden * cfg.intermediate
                    + 9 * cfg.hidden + cfg.intermediate)
    weights = embed + cfg.layers * layer
    if weight_budget is not None and weights > weight_budget:
        keep = resident_layers(layer, cfg.layers, embed, weight_budget)
        gpu_weights = embed + keep * layer + 2 * layer
    else:
        gpu_weights = weights
    tokens = batch * seq
    plan = plan_workspace(cfg, tokens, batch, dtype)
    host_io = plan.region("inputs").nbytes + tokens * cfg.hidden * size
    naive = naive_activation_bytes(cfg, batch, seq, size)
    return {
        "context": CONTEXT_BYTES_ESTIMATE,
        "weights": gpu_weights,
        "weights_total": weights,
        "workspace": plan.nbytes,
        "io_device": plan.region("inputs").nbytes,  # inside the workspace
        "io_host_pinned": host_io,
        "libraries": LIBRARY_BYTES,
        "peak": CONTEXT_BYTES_ESTIMATE + gpu_weights + plan.nbytes + LIBRARY_BYTES,
        "naive_activations": naive,
        "naive_peak": CONTEXT_BYTES_ESTIMATE + weights + naive,
        **{f"region_{r.name}": r.nbytes for r in plan.regions},
    }

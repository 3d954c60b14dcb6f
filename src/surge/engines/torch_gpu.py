"""The PyTorch engine: surge's own BERT-family encoder on a CUDA GPU (or the CPU).

On CUDA every run goes: tokens packed on the host (no padding) -> one pinned
int32 block -> one asynchronous H2D copy on this instance's stream -> replay of
the CUDA graph captured for the run's shape bucket -> one D2H copy of the
hidden states -> one event wait. The buckets are a small, fixed set (see
engines/buckets.py) and `warmup` captures every one of them, so nothing is
compiled or captured once the engine serves (`builds_after_ready` counts any
that are, and tests keep it at 0). Each instance has its own stream and
workspace; instances of one model share the weights.

On the CPU the same weights run through encoder_cpu.forward: packed GEMMs (oneDNN;
AMX tiles for bf16 where the CPU has them) and one batched attention call per layer.
"""

from __future__ import annotations

import contextlib

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from surge.engines.base import Capabilities, random_batch
from surge.engines.buckets import Buckets
from surge.engines.encoder import forward_fused, position_ids
from surge.engines.encoder_weights import EncoderWeights, load_weights
from surge.engines.graph_capture import capture
from surge.engines.memory import Workspace, plan_workspace
from surge.errors import EngineError, InvalidInput
from surge.types import Layout, TokenBatch

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (path, device, dtype) -> [weights, engines using them]: instances of one model share
# weights; the last close() frees them (a reloaded model version must not leak the old one).
_WEIGHTS: dict[tuple, list] = {}
_WEIGHTS_LOCK = threading.Lock()
GEMM_MODES = ("cublas", "mixed", "triton")
# Batches in flight per CUDA instance when the caller does not say. 1 in a process that also
# serves HTTP: on the H200 a second engine thread took the GIL from the event loop (one process
# fell from 2,496 to 1,420 req/s at 16 clients). The engine process of --workers sets 2
# (cli/workers.py): there nothing else wants the GIL, and two in flight gave 1.5x the batches/s
# of one at batch 64 (benchmarks/gpu_pipeline.py).
DEFAULT_PIPELINE_DEPTH = 1
# bias + GeLU in cuBLASLt's epilogue (the tanh form of GeLU): offered where approximate_gelu allows
LT_GELU = "cublaslt_gelu"
# every GEMM and the attention on one tiling for every batch (batch_invariant)
INVARIANT = "invariant"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def token_bucket(t: int) -> int:
    """Round a token count up: multiples of 16 up to 128, then steps of 1/8 of the power of two below."""
    if t <= 128:
        return max(16, (t + 15) // 16 * 16)
    step = 1 << (t.bit_length() - 4)
    return (t + step - 1) // step * step


def _weights_key(path: Path, device: torch.device, dtype: torch.dtype) -> tuple:
    return (str(Path(path).resolve()), str(device), dtype)


def shared_weights(path: Path, device: torch.device, dtype: torch.dtype) -> EncoderWeights:
    """The weights for (path, device, dtype), loaded once; each call takes a reference."""
    key = _weights_key(path, device, dtype)
    with _WEIGHTS_LOCK:
        entry = _WEIGHTS.get(key)
        if entry is None:
            entry = _WEIGHTS[key] = [load_weights(path).to(device, dtype), 0]
        entry[1] += 1
        return entry[0]


def release_weights(path: Path, device: torch.device, dtype: torch.dtype) -> None:
    key = _weights_key(path, device, dtype)
    with _WEIGHTS_LOCK:
        entry = _WEIGHTS.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _WEIGHTS[key]


# (weights key, token bucket) -> the GEMM mode gemm="auto" timed fastest. The mode changes the GEMMs
# only, whose shapes depend on the token bucket alone: buckets that differ in sequences or length
# reuse the choice, and so does a second instance of the model on the GPU (warm-up ~halved).
_MODE_CHOICE: dict[tuple, str] = {}


class TorchEngine:
    def __init__(self, device: str = "cuda", precision: str = "fp16", max_batch: int = 64,
                 max_tokens: int | None = None, cuda_graphs: bool = True, workspace: Workspace | None = None,
                 max_graphs: int = 48, gemm: str = "auto", weight_budget: int | None = None,
                 approximate_gelu: bool | None = None, threads: int = 0, pipeline_depth: int | None = None,
                 batch_invariant: bool | None = None):
        if precision not in _DTYPES:
            raise EngineError(f"the torch engine runs fp32, fp16 or bf16, not {precision!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise EngineError(f"device {device!r} asked for, but no CUDA GPU is available")
        self.precision = precision
        self.dtype = _DTYPES[precision]
        self.max_batch = max_batch
        self.max_tokens = max_tokens  # token capacity of one batch; default max_batch * max_length
        self.cuda_graphs = cuda_graphs
        self.max_graphs = max_graphs
        modes = GEMM_MODES + (LT_GELU, INVARIANT)
        if gemm not in ("auto",) + modes:
            raise EngineError(f"gemm must be auto or one of {modes}, not {gemm!r}")
        # Batch invariance (DESIGN.md: a result never depends on which other requests shared its
        # batch): one GEMM tiling, one attention tile and one pooling order for every bucket, where
        # the other modes pick per bucket (cuBLAS by shape, gemm="auto" by timing) and so round a
        # sentence's vector differently with its batch-mates (session 43 measured 44-54% of
        # sentences off in their last bits). The default; a named non-invariant mode turns it off.
        if batch_invariant is None:
            batch_invariant = gemm in ("auto", INVARIANT)
        if batch_invariant and gemm not in ("auto", INVARIANT):
            raise EngineError(f"gemm={gemm!r} sums in an order that depends on the batch: it needs "
                              "batch_invariant=False")
        self.batch_invariant = batch_invariant
        self.gemm = INVARIANT if batch_invariant else gemm
        # The tanh form differs from erf-GeLU by < 5e-4, under half an fp16 ulp at |x| > 0.25 and far
        # under bf16's: allowed by default in half precision, never in fp32 (tests check the cosine).
        self.approximate_gelu = precision != "fp32" if approximate_gelu is None else approximate_gelu
        self.weight_budget = weight_budget  # bytes of GPU memory for weights; beyond it layers stream from host
        self.threads = threads  # CPU only: torch intra-op threads (process-wide); 0 leaves torch's default
        self.offload = None
        self.choices: dict[tuple, dict[str, float]] = {}  # bucket -> {gemm mode: replay ms} (auto mode)
        self.mode_errors: dict[str, str] = {}  # modes that failed to build on this GPU, and why
        self._shared_ws = workspace
        self.weights: EncoderWeights | None = None
        self.capabilities: Capabilities | None = None
        self._lock = threading.RLock()
        self._hidden_lock = threading.Lock()  # run_hidden: one at a time, on its own staging buffers
        self._hidden_bufs = None
        self._graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self._slices: dict = {}  # _head / _numpy: slices made once (dropped with the graphs)
        self.head_set = None  # engines/heads.HeadSet computed inside the captured graph (attach_heads)
        self._dev_heads: list | None = None
        self._heads_mode = False  # the current _run_cuda call wants the heads' output (set under _lock)
        self.buckets: Buckets | None = None
        self.builds = 0  # buckets built (captured; compiled and tuned on first use)
        self.build_s = 0.0  # seconds spent building them
        self._sealed_builds: int | None = None  # `builds` when warm-up finished
        # Batches in flight on this instance's stream at once (double-buffered pinned staging): the
        # host packs and copies batch k+1 while the GPU runs batch k. EnginePool hands the instance
        # out this many times. 1 with a workspace shared between instances (their streams differ:
        # one's graph could overwrite the other's activations).
        pipelined = workspace is None and self.device.type == "cuda" and weight_budget is None
        depth = DEFAULT_PIPELINE_DEPTH if pipeline_depth is None else pipeline_depth
        self.pipeline_depth = max(1, depth) if pipelined else 1
        self._slots: list | None = None
        self.pool_mode: str | None = None  # pooling computed in the graph (attach_pooling); run() returns rows

    # ------------------------------------------------------------------ load
    def load(self, artifact: Path) -> None:
        path = Path(artifact)
        self._path = path
        self._wkey = _weights_key(path, self.device, self.dtype)
        try:
            if self.weight_budget is not None and self.device.type == "cuda":
                self._load_offloaded(path)
            else:
                self.weights = shared_weights(path, self.device, self.dtype)
        except torch.cuda.OutOfMemoryError as exc:
            raise EngineError(f"not enough GPU memory for the weights of {path}: {exc}") from exc
        cfg = self.weights.config
        self.config = cfg
        self.max_len = cfg.max_length
        self.capacity = self.max_tokens or min(self.max_batch * self.max_len, 65536)
        self.capabilities = Capabilities(self.max_batch, self.max_len, Layout.PACKED, str(self.device),
                                         self.precision, cfg.hidden)
        if self.device.type != "cuda":
            if self.threads:
                torch.set_num_threads(self.threads)  # process-wide: every CPU torch engine shares the setting
            from surge.engines.encoder_cpu import CpuEncoder, shorten_gil_switch

            shorten_gil_switch()

            # weights packed once for oneDNN; batch_invariant: every GEMM at one row count, each sequence
            # in its own attention block (encoder_cpu.InvariantPlan)
            self._cpu = CpuEncoder(self.weights, invariant=self.batch_invariant)
            return
        from surge.engines import kernels
        from surge.engines.encoder_cpu import shorten_gil_switch

        # The engine thread takes the GIL back after every wait on the GPU (the event, the
        # copies); behind a busy event loop each take waited up to the default 5 ms switch
        # interval, a stall per batch that grows with load (the profile: SM utilization
        # 14%, throughput falling from 16 to 256 clients). Same remedy as the CPU path.
        shorten_gil_switch()
        if not kernels.available():
            raise EngineError("the CUDA path of the torch engine needs Triton")
        self.plan = plan_workspace(cfg, token_bucket(self.capacity), _next_pow2(self.max_batch), self.dtype)
        self._make_buckets()
        try:
            self.workspace = self._shared_ws or Workspace(self.device)
            self.workspace.grow(self.plan.nbytes)
        except torch.cuda.OutOfMemoryError as exc:
            raise EngineError(f"not enough GPU memory for a {self.plan.nbytes / 2**20:.0f} MiB workspace "
                              f"({self.plan.tokens} tokens): lower max_batch or max_tokens") from exc
        self._ws_generation = self.workspace.generation
        self.stream = torch.cuda.Stream(self.device)
        self._h_inputs = torch.empty(self.plan.region("inputs").shape, dtype=torch.int32, pin_memory=True)
        out_dtype = torch.int16 if self.dtype == torch.bfloat16 else self.dtype  # numpy has no bf16
        self._h_out = torch.empty((self.plan.tokens, cfg.hidden), dtype=out_dtype, pin_memory=True)
        self._done = torch.cuda.Event()

    def _load_offloaded(self, path: Path) -> None:
        from dataclasses import replace

        from surge.engines.memory import OffloadedLayers, resident_layers

        host = load_weights(path).to("cpu", self.dtype)
        embed_bytes = sum(t.numel() * t.element_size() for t in host.embedding_tensors())
        keep = resident_layers(host.layers[0].nbytes(), len(host.layers), embed_bytes, self.weight_budget)
        emb = host.to(self.device) if keep == len(host.layers) else replace(
            host, layers=[], **{k: getattr(host, k).to(self.device) for k in ("word", "pos", "types", "emb_ln_w", "emb_ln_b")})
        if keep == len(host.layers):
            self.weights = emb
            return
        self.offload = OffloadedLayers(host.layers, keep, self.device)
        self.weights = emb
        self.cuda_graphs = False  # streamed layers run eagerly: the copy stream paces them anyway

    def warmup(self, shapes: list[tuple[int, int]]) -> None:
        """Build every bucket (CUDA graphs), then run `shapes`; later builds count as after-ready."""
        if self.device.type == "cuda" and self.buckets is not None:
            with self.on_device():
                for key in self.buckets.keys:
                    self._build(key)
        for b, s in shapes:
            b, s = min(b, self.max_batch), min(s, self.max_len)
            batch = random_batch(b, s, min(self.config.vocab, 30522), Layout.PACKED)
            self.run_heads(batch) if self.head_set is not None else self.run(batch)
        self._sealed_builds = self.builds

    @property
    def builds_after_ready(self) -> int:
        """Buckets built after warm-up: each one stalled serving (kept at 0 by the bucket set)."""
        return 0 if self._sealed_builds is None else self.builds - self._sealed_builds

    def _build(self, key) -> None:
        """Capture one bucket on valid synthetic inputs: full sequences of lb tokens, as many as fit."""
        bb, tb, lb = key
        lens = [lb] * (tb // lb) + ([tb % lb] if tb % lb else [])
        lengths = np.asarray(lens[:bb], dtype=np.int64)
        t = int(lengths.sum())
        rng = np.random.default_rng(tb * 1000 + lb)
        ids = rng.integers(0, min(self.config.vocab, 30522), t).astype(np.int64)
        types = np.zeros(t, np.int64)
        pos = position_ids(lengths, self.config.position_offset)
        with self._lock, self.workspace.lock:
            n = self._stage_inputs(ids, types, pos, lengths, key)
            inputs = self.workspace.view(self.plan.region("inputs"), (n,))
            with torch.cuda.stream(self.stream):
                inputs.copy_(self._h_inputs[:n], non_blocking=True)
            # A model with heads in its graph only ever runs the heads graphs: build those.
            self._heads_mode = self.head_set is not None
            self._graph(key)
            self.stream.synchronize()

    def close(self) -> None:
        """Drop graphs, buffers and this instance's reference to the weights (idempotent)."""
        with self._lock:
            self._graphs.clear()
            self._slices.clear()
            if self.weights is not None and self.offload is None and getattr(self, "_path", None) is not None:
                release_weights(self._path, self.device, self.dtype)
            self.weights = None
            self.offload = None
            for name in ("workspace", "_h_inputs", "_h_out", "stream", "_cpu"):
                if hasattr(self, name):
                    setattr(self, name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ run
    def _packed_arrays(self, batch: TokenBatch):
        if batch.layout is Layout.PACKED:
            return batch.input_ids, batch.token_type_ids, batch.lengths
        mask = batch.attention_mask.astype(bool)
        return batch.input_ids[mask], batch.token_type_ids[mask], batch.lengths

    def _inputs(self, batch: TokenBatch):
        """Checked packed (ids, types, positions, lengths) of a batch: what every run path feeds."""
        ids, types, lengths = self._packed_arrays(batch)
        self._check(ids, types, lengths)
        if self.config.type_vocab == 0:
            types = np.zeros_like(ids)
        return ids, types, position_ids(lengths, self.config.position_offset), lengths

    @staticmethod
    def _oom(lengths: np.ndarray) -> EngineError:
        # Free the cached blocks the failed batch left, so that the next (smaller) batch can run.
        torch.cuda.empty_cache()
        return EngineError(f"GPU out of memory on a batch of {len(lengths)} x {int(lengths.max())} tokens")

    def _check(self, ids: np.ndarray, types: np.ndarray, lengths: np.ndarray) -> None:
        if self.weights is None:
            raise EngineError("engine not loaded")
        if len(lengths) > self.max_batch:
            raise InvalidInput(f"batch of {len(lengths)} exceeds this engine's max_batch {self.max_batch}")
        if lengths.min() < 1 or lengths.max() > self.max_len:
            raise InvalidInput(f"sequence lengths must be 1..{self.max_len}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab):
            raise InvalidInput(f"token ids must be in 0..{self.config.vocab - 1}")
        if types.size and types.max() >= max(self.config.type_vocab, 1):
            raise InvalidInput("token type ids out of range")
        if ids.size > self.capacity:
            # Larger than the workspace was planned for: refuse this batch, keep serving others.
            raise EngineError(f"batch of {ids.size} tokens exceeds this engine's planned capacity of "
                              f"{self.capacity} tokens (max_tokens)")

    def run(self, batch: TokenBatch) -> np.ndarray:
        ids, types, pos, lengths = self._inputs(batch)
        try:
            if self.device.type == "cuda":
                with self.on_device():
                    packed = self._run_cuda(ids, types, pos, lengths)
            else:
                packed = self._run_reference(ids, types, pos, lengths)
        except torch.cuda.OutOfMemoryError as exc:
            raise self._oom(lengths) from exc
        if batch.layout is Layout.PACKED or self.pool_mode is not None:  # pooled: one row per sequence
            return packed
        out = np.zeros(batch.input_ids.shape + (packed.shape[1],), dtype=packed.dtype)
        out[batch.attention_mask.astype(bool)] = packed
        return out

    def on_device(self):
        """This engine's GPU as the calling thread's current device (a no-op on the CPU): cuBLAS
        handles and Triton launches follow the current device, not the tensors', and replicas on
        cuda:1 run from threads whose current device is cuda:0 (cuBLASLt: EXECUTION_FAILED)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _run_reference(self, ids, types, pos, lengths) -> np.ndarray:
        """The non-CUDA path: encoder_cpu (batched attention, packed oneDNN GEMMs)."""
        return self._cpu.run(ids, types, pos, lengths)

    def _make_buckets(self) -> None:
        self.buckets = Buckets(self.max_batch, self.max_len, self.plan.tokens)
        # Every bucket's graph is kept: an evicted one would be captured again while serving.
        self.max_graphs = max(self.max_graphs, len(self.buckets))

    def bucket(self, batch: int, tokens: int, max_len: int) -> tuple[int, int, int]:
        if self.buckets is None:  # subclasses that plan their own workspace (tensor-parallel shards)
            self._make_buckets()
        return self.buckets.key(batch, tokens, max_len)

    def _stage_inputs(self, ids, types, pos, lengths, key, host: torch.Tensor | None = None) -> int:
        bb, tb, _ = key
        t, b = len(ids), len(lengths)
        h = self._numpy(self._h_inputs if host is None else host)
        h[:3 * tb + bb + 1] = 0
        h[:t] = ids
        h[tb:tb + t] = types
        h[2 * tb:2 * tb + t] = pos
        cu = h[3 * tb:3 * tb + bb + 1]
        cu[1:b + 1] = np.cumsum(lengths)
        cu[b + 1:] = t  # empty sequences: their attention programs exit at once
        return 3 * tb + bb + 1

    def _views(self, key) -> dict[str, torch.Tensor]:
        bb, tb, _ = key
        return self.workspace.views(self.plan, tb, bb, self.config.heads * self.config.head_dim,
                                    self.config.intermediate)

    def modes(self, key) -> tuple[str, ...]:
        """The GEMM/fusion modes that can run a bucket; gemm="auto" times them all."""
        if self.batch_invariant:
            return (INVARIANT,)
        bb, tb, lb = key
        out = ("cublas", "mixed") + (("triton",) if tb <= 1024 else ())  # Triton's GEMM lost every large bucket
        if self.approximate_gelu or self.config.activation == "gelu_tanh":
            out += (LT_GELU,)
        return out

    def _forward(self, key, views, gemm: str) -> torch.Tensor:
        bb, tb, lb = key
        x = forward_fused(self.weights, views["inputs"], tb, bb, lb, views, gemm=gemm, offload=self.offload)
        if self._heads_mode:
            return self._heads_forward(x[:tb], views["inputs"], key)
        if self.pool_mode is not None:
            from surge.engines.device_pool import pool_on_device

            return pool_on_device(x, views["inputs"], key, self.pool_mode)
        return x

    # ------------------------------------------------------------------ pooling in the graph
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

    # ------------------------------------------------------------------ task heads in the graph
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

    def _capture(self, key, views, gemm: str):
        with torch.cuda.stream(self.stream):
            out = self._forward(key, views, gemm)  # compiles/tunes the Triton kernels, creates cuBLAS handles
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with capture(graph, stream=self.stream):
            out = self._forward(key, views, gemm)
        return graph, out

    def _time(self, graph, reps: int = 10) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            graph.replay()
            start.record(self.stream)
            for _ in range(reps):
                graph.replay()
            end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end) / reps

    def _graph(self, key):
        """(graph or None, views, output view, gemm mode) for a bucket; captured on first use.

        gemm="auto": every mode is captured and timed on this bucket, the fastest kept.
        """
        if self.workspace.generation != self._ws_generation:  # a shared workspace grew: old views are stale
            self._graphs.clear()
            self._slices.clear()
            self._ws_generation = self.workspace.generation
        gkey = key + (self._heads_mode,)  # hidden-state and heads graphs are kept apart
        g = self._graphs.get(gkey)
        if g is not None:
            self._graphs.move_to_end(gkey)
            return g
        import time

        started = time.perf_counter()
        views = self._views(key)
        modes = self.modes(key)
        mode = modes[0] if self.gemm == "auto" or self.gemm not in modes else self.gemm
        if not self.cuda_graphs:
            with torch.cuda.stream(self.stream):
                out = self._forward(key, views, mode)
            g = (None, views, out, mode)
        elif self.gemm != "auto" or (getattr(self, "_wkey", None), key[1]) in _MODE_CHOICE:
            if self.gemm == "auto":
                mode = _MODE_CHOICE[(self._wkey, key[1])]
                mode = mode if mode in modes else "cublas"
            graph, out = self._capture(key, views, mode)
            g = (graph, views, out, mode)
        else:
            best = None
            timings = {}
            for m in modes:
                try:
                    graph, out = self._capture(key, views, m)
                except Exception as exc:  # noqa: BLE001 - a variant that cannot build here is skipped, not fatal
                    if m == "cublas":
                        raise
                    self.mode_errors[m] = f"{type(exc).__name__}: {exc}"[:500]
                    torch.cuda.synchronize(self.device)
                    continue
                timings[m] = self._time(graph)
                if best is None or timings[m] < timings[best[3]]:
                    best = (graph, views, out, m)
            self.choices[key] = timings
            g = best
            if getattr(self, "_wkey", None) is not None:
                _MODE_CHOICE[(self._wkey, key[1])] = best[3]
        self._graphs[gkey] = g
        self.builds += 1
        self.build_s += time.perf_counter() - started
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return g

    def _ensure_slots(self) -> None:
        """The staging slots: (pinned inputs, pinned outputs, pinned heads output, done event) each.

        Slot 0 is the buffers load() made (subclasses that plan their own workspace make them
        too); the others are allocated here, on first use."""
        if self._slots is not None:
            return
        import queue

        with self._lock:
            if self._slots is not None:
                return
            heads = getattr(self, "_h_heads", None)
            pooled = getattr(self, "_h_pooled", None) if self.pool_mode is not None else None

            def like(t):
                return None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)

            slots = [(self._h_inputs, self._h_out, heads, self._done, pooled)]
            for _ in range(self.pipeline_depth - 1):
                slots.append((like(self._h_inputs), like(self._h_out), like(heads), torch.cuda.Event(), like(pooled)))
            free: queue.SimpleQueue = queue.SimpleQueue()
            for i in range(len(slots)):
                free.put(i)
            self._free_slots = free
            self._slots = slots

    def _run_cuda(self, ids, types, pos, lengths, heads: bool = False):
        return self._collect_cuda(self._launch_cuda(ids, types, pos, lengths, heads))

    def _launch_cuda(self, ids, types, pos, lengths, heads: bool = False) -> "Launched":
        """One batch, up to the GPU: pack into a free pinned slot (no lock: overlaps the other
        slot's batch on the GPU), then under the lock enqueue copy in -> graph replay -> copy out
        -> event on this instance's stream. `_collect_cuda` waits for the event without the lock
        (the next batch enqueues behind this one meanwhile). The stream orders the two batches'
        use of the workspace."""
        self._ensure_slots()
        t = len(ids)
        key = self.bucket(len(lengths), t, int(lengths.max()))
        ws_lock = self.workspace.lock
        slot = self._free_slots.get()
        h_in, h_out_all, h_heads, done, h_pooled = self._slots[slot]
        pooled = self.pool_mode is not None and not heads
        # A workspace shared with other instances (their own streams) is held until the batch is done.
        shared_ws = self._shared_ws is not None
        try:
            n = self._stage_inputs(ids, types, pos, lengths, key, h_in)
            with self._lock:
                ws_lock.acquire()
                try:
                    self._heads_mode = heads
                    inputs = self._inputs_view(n)
                    ready = self._ready_graph(key)
                    if ready is not None:
                        # A captured bucket (every one after warm-up): the whole batch in one stream
                        # context; each context resolves the device in Python (tens of us on the H200
                        # host, a lone request's launch: docs/benchmarks/serving_core.md, session 5).
                        graph, views, out, mode = ready
                        with torch.cuda.stream(self.stream):
                            inputs.copy_(self._head(h_in, n), non_blocking=True)
                            graph.replay()
                            h_out = self._copy_out(out, key, t, len(lengths), heads, pooled, h_out_all, h_heads, h_pooled)
                            done.record(self.stream)
                    else:
                        with torch.cuda.stream(self.stream):
                            # inputs first: a new bucket's first (eager) forward and its capture read them
                            inputs.copy_(h_in[:n], non_blocking=True)
                        graph, views, out, mode = self._graph(key)
                        with torch.cuda.stream(self.stream):
                            if graph is not None:
                                graph.replay()
                            else:
                                out = self._forward(key, views, mode)
                            h_out = self._copy_out(out, key, t, len(lengths), heads, pooled, h_out_all, h_heads, h_pooled)
                            done.record(self.stream)
                    if shared_ws:
                        done.synchronize()
                finally:
                    ws_lock.release()
        except BaseException:
            self._free_slots.put(slot)
            raise
        return Launched(self, slot, done, h_out, key, t, len(lengths), heads, pooled)

    def _copy_out(self, out, key, t: int, b: int, heads: bool, pooled: bool, h_out_all, h_heads, h_pooled):
        """Enqueue the batch's result into its pinned slot (on the current stream); the slot's view."""
        head = self._head
        if heads:  # the graph's output is the heads' logits: [bb, fixed] then [tb, widths]
            n = key[0] * self._fixed + t * self._tok_width
            h_out = head(h_heads, n)
            h_out.copy_(head(out, n), non_blocking=True)
        elif pooled:  # the graph's output is the pooled rows: [bb, hidden] float32
            h_out = head(h_pooled, b)
            h_out.copy_(head(out, b), non_blocking=True)
        else:
            h_out = head(h_out_all, t)
            h_out.copy_(out[:t].view(h_out.dtype), non_blocking=True)
        return h_out

    def _head(self, tensor: torch.Tensor, n: int) -> torch.Tensor:
        """`tensor[:n]`, made once per tensor and size: a slice is several torch calls, and a lone
        request's launch makes three (pinned inputs, graph output, pinned output). The view keeps
        its base alive, so a key's id() cannot be reused by another tensor while it is here; the
        sizes are bounded by the buckets."""
        memo = self._slices
        k = (id(tensor), n)
        v = memo.get(k)
        if v is None:
            if len(memo) > 4096:  # a bound, should buckets ever be many more than planned
                memo.clear()
            v = memo[k] = tensor[:n]
        return v

    def _numpy(self, tensor: torch.Tensor):
        """A pinned host tensor's numpy view, made once (as `_head`)."""
        memo = self._slices
        k = (id(tensor), "np")
        v = memo.get(k)
        if v is None:
            v = memo[k] = (tensor, tensor.numpy())
        return v[1]

    def _ready_graph(self, key):
        """The bucket's captured graph entry when nothing needs building first, else None (`_graph` then)."""
        if not self.cuda_graphs or self.workspace.generation != self._ws_generation:
            return None
        gkey = key + (self._heads_mode,)
        g = self._graphs.get(gkey)
        if g is None or g[0] is None:
            return None
        self._graphs.move_to_end(gkey)
        return g

    def _inputs_view(self, n: int) -> torch.Tensor:
        """The workspace's first `n` input slots, made once per size (a view costs several torch calls)."""
        gen = self.workspace.generation
        if getattr(self, "_in_views_gen", None) != gen:
            self._in_views, self._in_views_gen = {}, gen
        v = self._in_views.get(n)
        if v is None:
            v = self._in_views[n] = self.workspace.view(self.plan.region("inputs"), (n,))
        return v

    def _collect_cuda(self, job: "Launched"):
        try:
            job.done.synchronize()
            res = job.h_out.numpy().copy()
        finally:
            self._free_slots.put(job.slot)
        if job.heads:
            bb, t, b = job.key[0], job.tokens, job.rows
            fixed = res[:bb * self._fixed].reshape(bb, self._fixed)[:b]
            tokens = res[bb * self._fixed:].reshape(t, self._tok_width) if self._tok_width else None
            return fixed, tokens
        if self.dtype == torch.bfloat16 and not job.pooled:
            res = (res.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return res

    # ------------------------------------------------------------------ launch / collect (pooled rows)
    def launch(self, batch: TokenBatch) -> "Launched":
        """The host part of run() (checks, packing, copy, graph launch), returning at once; the
        caller waits (`Launched.wait`, off its event loop) then takes the rows (`collect`). With
        pooling in the graph only: run() is collect(launch()). The batcher calls launch and collect
        on its event loop and only the wait on a thread: no GIL hand-offs for the host work."""
        if self.pool_mode is None or self.device.type != "cuda":
            raise EngineError("launch/collect needs pooling in the graph on CUDA (attach_pooling)")
        ids, types, pos, lengths = self._inputs(batch)
        try:
            with self.on_device():
                return self._launch_cuda(ids, types, pos, lengths)
        except torch.cuda.OutOfMemoryError as exc:
            raise self._oom(lengths) from exc

    def collect(self, job: "Launched") -> np.ndarray:
        return self._collect_cuda(job)


class Launched:
    """A batch on its way through the GPU (TorchEngine.launch): wait() blocks without the GIL."""

    __slots__ = ("engine", "slot", "done", "h_out", "key", "tokens", "rows", "heads", "pooled")

    def __init__(self, engine, slot, done, h_out, key, tokens, rows, heads, pooled):
        self.engine, self.slot, self.done, self.h_out, self.key = engine, slot, done, h_out, key
        self.tokens, self.rows, self.heads, self.pooled = tokens, rows, heads, pooled

    def wait(self) -> None:
        self.done.synchronize()

    def ready(self) -> bool:
        return self.done.query()

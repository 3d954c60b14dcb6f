"""The PyTorch engine: surge's own BERT-family encoder on a CUDA GPU (or the CPU).

On CUDA every run goes: tokens packed on the host (no padding) -> one pinned
int32 block -> one asynchronous H2D copy on this instance's stream -> replay of
the CUDA graph captured for the run's shape bucket -> one D2H copy of the
hidden states -> one event wait. The buckets are a small, fixed set (see
engines/buckets.py) and `warmup` captures every one of them, so nothing is
compiled or captured once the engine serves (`builds_after_ready` counts any
that are, and tests keep it at 0). Each instance has its own stream and
workspace; instances of one model share the weights.
The CUDA run path (pinned staging, launch / collect) is engines/torch_launch.py, the graphs'
capture and GEMM-mode timing engines/torch_graphs.py, pooling and task heads in the graph
engines/torch_heads.py (mixins of TorchEngine); the weights' registry engines/shared_weights.py.

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
from surge.engines.graph_capture import device_wide
from surge.engines.memory import Workspace, plan_workspace
from surge.engines.shared_weights import _weights_key, release_weights, shared_weights
from surge.engines.torch_graphs import BucketGraphs
from surge.engines.torch_heads import GraphHeads
from surge.engines.torch_launch import PinnedLaunch
from surge.errors import EngineError, InvalidInput
from surge.types import Layout, TokenBatch

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
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


class TorchEngine(PinnedLaunch, BucketGraphs, GraphHeads):
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
            device_wide(torch.cuda.empty_cache)  # not while another engine captures: engines/graph_capture.py

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
        device_wide(torch.cuda.empty_cache)
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


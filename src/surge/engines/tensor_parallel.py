"""A tensor-parallel encoder: attention heads and FFN columns split over ranks.

One process per rank. Rank 0 lives in the serving process and is the Engine the
server talks to; ranks 1..N-1 are worker processes it spawns (or, under
torchrun, processes started alongside it: `serve_rank`). Per batch:

    rank 0: validate -> broadcast [cmd, T, B] + ids|types|lengths -> forward
    rank r: wait for the broadcast                                 -> forward

and every layer's forward sums the partial outputs of the out-projection and
the FFN-out GEMM with an all-reduce (encoder.layer_* `reduce`), after which
every rank holds the same full hidden states; rank 0 returns them.

Batch invariant by default (`batch_invariant`, the torch engine's setting): a
sequence's hidden states are bit for bit the same whatever shares its batch.
Each shard runs the torch engine's invariant forward (CPU: tp_cpu, the row-bound
GEMM calls and one attention block per sequence; CUDA: the one-tiling Triton
GEMMs and fixed attention tile, gemm="invariant"), and the partials are summed
in rank order (Groups.sum_in_rank_order).

Two process groups: `control` (gloo, CPU tensors, no timeout: idle workers
block in its broadcast for as long as the server idles, and leave when rank 0's
socket closes) and `data` (NCCL on CUDA, gloo on the CPU, with a timeout) for
the all-reduces. On CUDA each rank replays one CUDA graph per shape bucket,
NCCL all-reduces included (the TorchEngine machinery, see ShardRunner).
World size 1 needs neither groups nor processes.

NVLink multicast stays off in every process that touches NCCL (NCCL_ENV).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from surge.engines.base import Capabilities, random_batch
from surge.engines.encoder import embed_reference, layer_reference
from surge.engines.encoder_weights import EncoderConfig, EncoderWeights
from surge.engines.memory import Workspace, plan_workspace
from surge.engines.torch_gpu import _DTYPES, TorchEngine, _next_pow2, token_bucket
from surge.engines.tp_weights import build_shard, check_split, source_config
from surge.errors import ConfigError, EngineError, SurgeError
from surge.types import Layout, TokenBatch

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CMD_RUN, CMD_STOP, CMD_PROFILE = 1, 2, 3
_HEADER = 4  # cmd, tokens, batch, argument (profile iterations)
_NEVER = timedelta(days=3650)

Source = Path | EncoderConfig  # a HF model directory, or a shape for random weights


@dataclass(frozen=True)
class TPOptions:
    world: int = 2
    devices: tuple[int, ...] | None = None  # CUDA ordinals, one per rank; None: every rank on the CPU
    precision: str = "fp32"
    max_batch: int = 64
    max_tokens: int | None = None
    cuda_graphs: bool = True
    seed: int = 0  # random weights only
    threads: int = 0  # CPU threads per rank, rank 0's process included (0: torch's default)
    timeout_s: float = 300.0  # a collective that takes longer means a rank is gone
    start_timeout_s: float = 1800.0  # loading/generating the shards
    batch_invariant: bool = True  # the torch engine's setting: a sequence's result is the same in any batch

    def device(self, rank: int) -> torch.device:
        return torch.device("cpu") if self.devices is None else torch.device("cuda", self.devices[rank])


# ---------------------------------------------------------------- process groups

class Groups:
    """This rank's control and data groups, built on a shared store (not the default group)."""

    def __init__(self, store, rank: int, world: int, device: torch.device, timeout_s: float):
        self.rank, self.world = rank, world
        self.control = _gloo(dist.PrefixStore("surge-tp/control", store), rank, world, _NEVER)
        data_store = dist.PrefixStore("surge-tp/data", store)
        if device.type == "cuda":
            os.environ.update(NCCL_ENV)
            self.data = dist.ProcessGroupNCCL(data_store, rank, world)
        else:
            self.data = _gloo(data_store, rank, world, timedelta(seconds=timeout_s))

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks; what encoder.layer_* call as `reduce` (batch_invariant=False)."""
        self.data.allreduce([t]).wait()
        return t

    def sum_in_rank_order(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks that gives an element the same bits whatever the message holds:
        ((p0 + p1) + p2) + ..., on every rank; the `reduce` of a batch-invariant forward.

        A ring all-reduce adds an element's partials in an order set by the segment of the message it falls
        in, so over 3+ ranks the same row rounds apart in a batch of another size (gloo, 3 and 4 ranks: every
        row measured moved, tests/unit/test_tensor_parallel_batch_invariance; NCCL's ring and tree cut the
        message into channels and chunks by its size too: not measured, treated alike).
        Over 2 ranks an element's sum is one addition, p0 + p1 == p1 + p0 exactly: the all-reduce is kept.
        Beyond, every rank gathers all partials (world x the bytes of t, against the ring's 2 (world-1)/world)
        and adds them in rank order.
        """
        if self.world <= 2:
            return self.all_reduce(t)
        parts = t.new_empty((self.world * t.shape[0],) + tuple(t.shape[1:]))
        self.data._allgather_base(parts, t.contiguous()).wait()
        parts = parts.view((self.world,) + tuple(t.shape))
        torch.add(parts[0], parts[1], out=t)
        for r in range(2, self.world):
            t.add_(parts[r])
        return t

    def broadcast(self, t: torch.Tensor) -> None:
        self.control.broadcast(t, 0).wait()


def _gloo(store, rank: int, world: int, timeout: timedelta):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # ranks share one host
    return dist.ProcessGroupGloo(store, rank, world, opts)


# ---------------------------------------------------------------- one rank's compute

def forward_shard_reference(w: EncoderWeights, ids, types, pos, cu: list[int], reduce) -> torch.Tensor:
    x = embed_reference(w, ids, types, pos)
    for lw in w.layers:
        x = layer_reference(x, lw, cu, w.config, reduce=reduce)
    return x


def forward_shard_fused(w: EncoderWeights, inputs: torch.Tensor, tokens: int, batch: int, max_len: int,
                        ws: dict[str, torch.Tensor], reduce, gemm: str = "cublas") -> torch.Tensor:
    """encoder.forward_fused with a `reduce` after each partial GEMM; gemm: encoder.layer_fused's mode."""
    from surge.engines.encoder import layer_fused
    from surge.engines.kernels.norm import embed_layernorm

    ids, types, pos = inputs[:tokens], inputs[tokens:2 * tokens], inputs[2 * tokens:3 * tokens]
    cu = inputs[3 * tokens:]
    x = ws["x"]
    embed_layernorm(ids, types, pos, w.word, w.pos, w.types, w.emb_ln_w, w.emb_ln_b, w.config.eps, out=x)
    for lw in w.layers:
        layer_fused(x, lw, cu, max_len, batch, w.config, ws, reduce=reduce, gemm=gemm)
    return x


class ShardRunner(TorchEngine):
    """The TorchEngine (packing, buckets, workspace, CUDA graphs) over one rank's shard.

    Only what a shard changes is overridden: where the weights come from, the
    shard's QKV and FFN widths in the workspace, and the `reduce` in the forward.
    batch_invariant: the torch engine's invariant forward (CUDA: gemm="invariant";
    CPU: tp_cpu.ShardCpuEncoder), else cuBLAS / the reference path.
    """

    def __init__(self, weights: EncoderWeights, device, precision: str, max_batch: int,
                 max_tokens: int | None = None, cuda_graphs: bool = True, reduce=None, batch_invariant: bool = True):
        # gemm fixed (no per-rank timing of variants): ranks must record identical graphs.
        super().__init__(device=str(device), precision=precision, max_batch=max_batch, max_tokens=max_tokens,
                         cuda_graphs=cuda_graphs, gemm="invariant" if batch_invariant else "cublas",
                         batch_invariant=batch_invariant)
        self.reduce = reduce
        self._attach(weights)

    def load(self, artifact) -> None:  # a shard comes built (tp_weights.build_shard)
        raise EngineError("a ShardRunner is built from a shard, not loaded from a path")

    def _attach(self, w: EncoderWeights) -> None:
        # mirrors TorchEngine.load after its weights are read
        self.weights, cfg = w, w.config
        self.config = cfg
        self.max_len = cfg.max_length
        self.capacity = self.max_tokens or min(self.max_batch * self.max_len, 65536)
        self.capabilities = Capabilities(self.max_batch, self.max_len, Layout.PACKED, str(self.device),
                                         self.precision, cfg.hidden)
        if self.device.type != "cuda":
            if self.batch_invariant:
                from surge.engines.tp_cpu import ShardCpuEncoder

                self._cpu = ShardCpuEncoder(w)  # probes its GEMMs' row bounds now, at load
            return
        lw = w.layers[0]
        self.plan = plan_workspace(cfg, token_bucket(self.capacity), _next_pow2(self.max_batch), self.dtype,
                                   heads=lw.heads, ffn=lw.w1.shape[0])
        try:
            self.workspace = Workspace(self.device, self.plan.nbytes)
        except torch.cuda.OutOfMemoryError as exc:
            raise EngineError(f"not enough GPU memory for a {self.plan.nbytes / 2**20:.0f} MiB workspace") from exc
        self._ws_generation = self.workspace.generation
        self.stream = torch.cuda.Stream(self.device)
        self._h_inputs = torch.empty(self.plan.region("inputs").shape, dtype=torch.int32, pin_memory=True)
        out_dtype = torch.int16 if self.dtype == torch.bfloat16 else self.dtype
        self._h_out = torch.empty((self.plan.tokens, cfg.hidden), dtype=out_dtype, pin_memory=True)
        self._done = torch.cuda.Event()

    def _views(self, key) -> dict[str, torch.Tensor]:
        bb, tb, _ = key  # this shard's QKV and FFN widths, not the whole model's
        lw = self.weights.layers[0]
        v = self.workspace.views(self.plan, tb, bb, lw.heads * self.config.head_dim, lw.w1.shape[0])
        v["ffn"] = self.workspace.view(self.plan.region("big"), (tb, lw.w1.shape[0]))
        return v

    def _forward(self, key, views, gemm: str | None = None) -> torch.Tensor:
        bb, tb, lb = key  # one mode on every rank (never timed per rank): every rank captures the same collectives
        return forward_shard_fused(self.weights, views["inputs"], tb, bb, lb, views, self.reduce, gemm=self.gemm)

    def _run_reference(self, ids, types, pos, lengths) -> np.ndarray:
        if self.batch_invariant:
            return self._cpu.run(ids, types, pos, lengths, self.reduce)
        cu = [0] + np.cumsum(lengths).tolist()
        with torch.inference_mode():
            t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(self.device)  # noqa: E731
            x = forward_shard_reference(self.weights, t(ids), t(types), t(pos), cu, self.reduce)
            return x.float().cpu().numpy()


# ---------------------------------------------------------------- the wire format of a batch

def _send(groups: Groups, cmd: int, ids=None, types=None, lengths=None, arg: int = 0) -> None:
    t, b = (0, 0) if ids is None else (len(ids), len(lengths))
    groups.broadcast(torch.tensor([cmd, t, b, arg], dtype=torch.int64))
    if ids is not None:
        groups.broadcast(torch.from_numpy(np.concatenate([ids, types, lengths]).astype(np.int64)))


def _receive(groups: Groups) -> tuple[int, int, TokenBatch | None]:
    header = torch.zeros(_HEADER, dtype=torch.int64)
    groups.broadcast(header)
    cmd, t, b, arg = (int(v) for v in header)
    if t == 0:
        return cmd, arg, None
    block = torch.empty(2 * t + b, dtype=torch.int64)
    groups.broadcast(block)
    a = block.numpy()
    ids, types, lengths = a[:t], a[t:2 * t], a[2 * t:]
    cu = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    return cmd, arg, TokenBatch(ids, np.ones_like(ids), types, lengths, Layout.PACKED, cu)


def _build_runner(source: Source, rank: int, opts: TPOptions, groups: Groups | None) -> ShardRunner:
    device = opts.device(rank)
    weights = build_shard(source, rank, opts.world, device, _DTYPES[opts.precision], opts.seed)
    reduce = None if groups is None else groups.sum_in_rank_order if opts.batch_invariant else groups.all_reduce
    return ShardRunner(weights, device, opts.precision, opts.max_batch, opts.max_tokens, opts.cuda_graphs,
                       reduce=reduce, batch_invariant=opts.batch_invariant)


def _build_runner_or_error(source: Source, rank: int, opts: TPOptions, groups: Groups | None) -> ShardRunner:
    try:
        return _build_runner(source, rank, opts, groups)
    except SurgeError:
        raise
    except torch.cuda.OutOfMemoryError as exc:
        raise EngineError(f"not enough GPU memory for rank {rank}'s shard: {exc}") from exc
    except Exception as exc:  # safetensors, torch: their own exception types
        raise EngineError(f"cannot build rank {rank}'s shard of {source}: {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------- ranks 1..N-1

def serve_rank(store, rank: int, source: Source, opts: TPOptions) -> int:
    """A worker rank's whole life: build its shard, then follow rank 0's broadcasts until told to stop."""
    device = opts.device(rank)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        if opts.threads:
            torch.set_num_threads(opts.threads)
        store.set(f"hello/{rank}", "1")
        groups = Groups(store, rank, opts.world, device, opts.timeout_s)
        runner = _build_runner(source, rank, opts, groups)
    except Exception as exc:  # reported to rank 0, which raises it as an EngineError
        store.set(f"ready/{rank}", f"error: {type(exc).__name__}: {exc}")
        return 1
    store.set(f"ready/{rank}", "ok")
    groups.all_reduce(torch.zeros(1, device=device))  # creates the NCCL communicator before any capture
    from surge.engines.tp_profile import profile

    try:
        while True:
            cmd, arg, batch = _receive(groups)
            if cmd == CMD_STOP:
                return 0
            if cmd == CMD_RUN:
                runner.run(batch)
            elif cmd == CMD_PROFILE:
                profile(runner, groups, batch, arg)
    except Exception:  # rank 0 went away (its sockets closed) or a collective failed: nothing to serve
        return 1


def _spawned_rank(rank: int, host: str, port: int, source: Source, opts: TPOptions) -> None:
    if opts.devices is not None:
        os.environ.update(NCCL_ENV)
    store = dist.TCPStore(host, port, opts.world, False, timedelta(seconds=opts.timeout_s))
    raise SystemExit(serve_rank(store, rank, source, opts))


# ---------------------------------------------------------------- rank 0: the engine

class TensorParallelEngine:
    """The Engine contract over `world` ranks; this process is rank 0.

    launcher "spawn": rank 0 starts ranks 1..N-1 (torch.multiprocessing, spawn).
    launcher "env": ranks were started by torchrun (RANK/WORLD_SIZE/MASTER_*);
    this must be rank 0 and the others run `serve_rank` (see `torchrun_main`; its TPOptions must
    match this engine's, batch_invariant included).
    batch_invariant: a sequence's hidden states bit for bit the same whatever shares its batch (the
    torch engine's setting and default); False: cuBLAS GEMMs / the reference path on the whole batch.
    """

    def __init__(self, world: int = 2, devices: list[int] | None = None, precision: str = "fp32",
                 max_batch: int = 64, max_tokens: int | None = None, cuda_graphs: bool = True, seed: int = 0,
                 threads: int = 0, timeout_s: float = 300.0, launcher: str = "spawn", batch_invariant: bool = True):
        if devices is not None and len(devices) != world:
            raise EngineError(f"tensor parallelism over {world} ranks needs {world} devices, got {devices}")
        if devices is not None and len(set(devices)) != len(devices):
            raise EngineError(f"tensor-parallel ranks need distinct GPUs (NCCL refuses two on one), got {devices}")
        if devices is not None and not torch.cuda.is_available():
            raise EngineError("CUDA devices asked for, but no CUDA GPU is available")
        if launcher not in ("spawn", "env"):
            raise EngineError(f"launcher must be spawn or env, not {launcher!r}")
        self.opts = TPOptions(world, None if devices is None else tuple(devices), precision, max_batch, max_tokens,
                              cuda_graphs, seed, threads, timeout_s, batch_invariant=batch_invariant)
        self.launcher = launcher
        self.capabilities: Capabilities | None = None
        self.runner: ShardRunner | None = None
        self.groups: Groups | None = None
        self._procs: list = []
        self._lock = threading.Lock()
        self._broken: str | None = None

    @property
    def world(self) -> int:
        return self.opts.world

    def load(self, artifact: Source) -> None:
        source = artifact if isinstance(artifact, EncoderConfig) else Path(artifact)
        check_split(source_config(source), self.world)
        if isinstance(source, Path) and not (any(source.glob("*.safetensors"))
                                             or (source / "pytorch_model.bin").is_file()):
            raise ConfigError(f"{source}: no *.safetensors or pytorch_model.bin")  # before starting any rank
        device = self.opts.device(0)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif self.opts.threads:
            # ranks on one host's CPU: idle OpenMP threads of one rank spinning would starve the others
            torch.set_num_threads(self.opts.threads)
        if self.world > 1:
            store = self._start_ranks(source)
            try:
                self._wait(store, "hello", time.monotonic() + self.opts.timeout_s)
                self.groups = Groups(store, 0, self.world, device, self.opts.timeout_s)
                self.runner = _build_runner_or_error(source, 0, self.opts, self.groups)
                self._wait(store, "ready", time.monotonic() + self.opts.start_timeout_s)
                self.groups.all_reduce(torch.zeros(1, device=device))
            except BaseException:
                self.close()
                raise
        else:
            self.runner = _build_runner_or_error(source, 0, self.opts, None)
        self.config = self.runner.config
        self.capabilities = self.runner.capabilities

    def _start_ranks(self, source: Source):
        if self.launcher == "env":
            store, rank, world = next(dist.rendezvous("env://"))
            if rank != 0 or world != self.world:
                raise EngineError(f"the engine must be rank 0 of {self.world}, torchrun made it {rank} of {world}")
            return store
        import torch.multiprocessing as mp

        if self.opts.devices is not None:
            os.environ.update(NCCL_ENV)  # rank 0 runs NCCL in this process; children inherit it too
        store = dist.TCPStore("127.0.0.1", 0, self.world, True, timedelta(seconds=self.opts.timeout_s),
                              wait_for_workers=False)
        ctx = mp.get_context("spawn")
        for r in range(1, self.world):
            p = ctx.Process(target=_spawned_rank, args=(r, "127.0.0.1", store.port, source, self.opts),
                            name=f"surge-tp-rank{r}", daemon=True)
            p.start()
            self._procs.append(p)
        return store

    def _wait(self, store, what: str, deadline: float) -> None:
        """Wait for every worker's `what` key; a worker that died or failed is an EngineError."""
        from multiprocessing.connection import wait as wait_for_exit

        for r in range(1, self.world):
            while not store.check([f"{what}/{r}"]):
                # wakes at once when a rank process dies; re-checks the store every 50 ms
                if self._procs:
                    wait_for_exit([p.sentinel for p in self._procs], timeout=0.05)
                else:  # torchrun's ranks: not our children
                    time.sleep(0.05)
                dead = [p for p in self._procs if p.exitcode is not None]
                if dead and not store.check([f"{what}/{r}"]):
                    raise EngineError(f"tensor-parallel rank process {dead[0].name} exited "
                                      f"({dead[0].exitcode}) while starting")
                if time.monotonic() > deadline:
                    raise EngineError(f"tensor-parallel rank {r} did not report {what!r} in time")
            value = store.get(f"{what}/{r}").decode()
            if value.startswith("error"):
                raise EngineError(f"tensor-parallel rank {r} failed to load: {value[7:]}")

    def warmup(self, shapes: list[tuple[int, int]]) -> None:
        for b, s in shapes:
            b, s = min(b, self.opts.max_batch), min(s, self.runner.max_len)
            self.run(random_batch(b, s, min(self.config.vocab, 30522), Layout.PACKED))

    def _usable(self) -> None:
        if self.runner is None:
            raise EngineError("engine not loaded")
        if self._broken:
            raise EngineError(f"the tensor-parallel group is broken: {self._broken}")

    def run(self, batch: TokenBatch) -> np.ndarray:
        self._usable()
        ids, types, lengths = self.runner._packed_arrays(batch)
        self.runner._check(ids, types, lengths)  # bad input stops here, before any rank sees it
        with self._lock:
            self._usable()
            if self.groups is None:
                return self.runner.run(batch)
            try:
                _send(self.groups, CMD_RUN, ids, types, lengths)
                return self.runner.run(batch)
            except Exception as exc:  # the ranks are out of step now: no later batch can be trusted
                self._broken = f"{type(exc).__name__}: {exc}"
                raise EngineError(f"tensor-parallel run failed: {self._broken}") from exc

    def profile(self, batch: TokenBatch, iters: int = 20) -> dict:
        """Where one batch's time goes on rank 0: total, compute alone, all-reduces alone (ms, medians)."""
        from surge.engines.tp_profile import profile

        self._usable()
        ids, types, lengths = self.runner._packed_arrays(batch)
        self.runner._check(ids, types, lengths)
        with self._lock:
            if self.groups is not None:
                _send(self.groups, CMD_PROFILE, ids, types, lengths, arg=iters)
            packed = TokenBatch(ids, np.ones_like(ids), types, lengths, Layout.PACKED,
                                np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
            with self.runner.on_device():  # the calling thread's current device may be another GPU
                return profile(self.runner, self.groups, packed, iters)

    def close(self) -> None:
        with self._lock:
            if self.groups is not None and not self._broken:
                try:
                    _send(self.groups, CMD_STOP)
                except Exception:
                    pass
            for p in self._procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
            self._procs = []
            self.groups = None
            if self.runner is not None:
                self.runner.close()
            self.runner = None


def torchrun_main(source: Source, opts: TPOptions) -> int | None:
    """Under torchrun: ranks > 0 serve (returning their exit code); rank 0 gets None and builds the engine
    with launcher="env"."""
    rank = int(os.environ["RANK"])
    if rank == 0:
        return None
    if opts.devices is not None:
        os.environ.update(NCCL_ENV)
    store, rank, _ = next(dist.rendezvous("env://"))
    return serve_rank(store, rank, source, opts)

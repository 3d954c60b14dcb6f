"""The served face of a tensor model (kinds onnx, torch, python): tensors by name in, tensors out.

A request goes: validate against the model's contract (names, datatypes,
shapes, batch size; 400 otherwise) -> cache (keyed on the tensors' bytes) ->
the dynamic batcher (one item per request, weighing its N rows; the batch's
row budget is max_batch_size) -> the backend in an executor thread -> this
request's own result. A backend gets a list of requests and returns one result
(outputs or an error) per request, so an error only ever fails its own request
and no request sees another's rows.

The batcher (runtime/batcher.py) is used unchanged: its items only need a
length, and its per-item result rows here are Python objects (a dict of
arrays, or the request's exception).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from prometheus_client import CollectorRegistry

from surge.config import BatchingConfig, CacheConfig, LimitsConfig
from surge.errors import EngineError, InvalidInput, NotReady, SurgeError, WrongTask
from surge.models.tensor_config import TensorModelConfig, TensorSpec
from surge.runtime.batcher import BatcherConfig, DynamicBatcher
from surge.runtime.metrics import ServiceMetrics
from surge.runtime.outcome import answered, count_failures

NUMPY_OF = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
            "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
            "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_}


def datatype_of(array: np.ndarray) -> str:
    """The KServe v2 datatype of an array (object and string arrays are BYTES)."""
    if array.dtype.kind in "OSU":
        return "BYTES"
    for name, t in NUMPY_OF.items():
        if name != "BYTES" and array.dtype == np.dtype(t):
            return name
    raise EngineError(f"arrays of dtype {array.dtype} have no KServe v2 datatype")


Outputs = dict[str, np.ndarray]


class TensorBackend(Protocol):
    """What runs a tensor model. Sync; called from one executor thread per instance."""

    def run_requests(self, requests: list[Outputs], parameters: list[dict] | None = None,
                     callers: list[tuple[str, ...]] | None = None,
                     outputs: list | None = None) -> list[Outputs | SurgeError]:
        """One result per request, in order: its outputs, or the error that fails it alone.
        `parameters`: each request's KServe parameters (a python model sees them; graphs do not).
        `callers`: each request's chain of python models waiting on it (their in-process client calls).
        `outputs`: the output names each request asked for (a python model sees them; a graph computes all)."""
        ...

    def close(self) -> None: ...


@dataclass
class TensorResult:
    outputs: Outputs
    model: str
    version: str
    batch_size: int
    cached: list[bool] = field(default_factory=list)
    timings: dict = field(default_factory=dict)  # queue_ns, compute_infer_ns (the batcher's), for the statistics

    @property
    def vectors(self) -> range:
        """What the KServe statistics count as inferences: the request's rows."""
        return range(self.batch_size)


@dataclass(eq=False)
class _Item:
    inputs: Outputs
    rows: int
    parameters: dict = field(default_factory=dict)
    callers: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()  # the outputs asked for (all of the config's when the client named none)

    def __len__(self) -> int:  # the batcher's "tokens": rows against the row budget
        return self.rows


class _TensorCache:
    """Byte-bounded LRU of whole responses, keyed on the request's tensors' bytes."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self.entries: collections.OrderedDict[bytes, tuple[Outputs, int]] = collections.OrderedDict()
        self.hits = self.misses = 0

    @staticmethod
    def key(inputs: Outputs, parameters: dict | None = None, outputs: list[str] | None = None) -> bytes:
        h = hashlib.blake2b(digest_size=20)
        if parameters:  # a python model's answer may depend on them (request.parameters())
            h.update(b"parameters\0" + json.dumps(parameters, sort_keys=True, default=str).encode() + b"\0")
        if outputs:  # and on the outputs asked for (request.requested_output_names())
            h.update(b"outputs\0" + "\0".join(outputs).encode() + b"\0\0")
        for name in sorted(inputs):
            a = inputs[name]
            h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
            if a.dtype == object:
                for v in a.ravel():
                    h.update(len(v).to_bytes(4, "little") + v)
            else:
                h.update(np.ascontiguousarray(a).tobytes())
        return h.digest()

    def get(self, key: bytes) -> Outputs | None:
        hit = self.entries.get(key)
        if hit is None:
            self.misses += 1
            return None
        self.entries.move_to_end(key)
        self.hits += 1
        return hit[0]

    def put(self, key: bytes, outputs: Outputs) -> None:
        size = sum(a.nbytes if a.dtype != object else sum(map(len, a.ravel())) for a in outputs.values()) + 64
        if size > self.max_bytes // 4 or key in self.entries:
            return
        self.entries[key] = (outputs, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, s) = self.entries.popitem(last=False)
            self.bytes -= s


def random_inputs(specs: list[TensorSpec], batched: bool, seed: int = 0) -> Outputs:
    """Warm-up inputs of batch 1 (dims of any size take 1); small random values, never all zeros."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in specs:
        shape = ([1] if batched else []) + [d if d > 0 else 1 for d in t.dims]
        if t.datatype == "BYTES":
            out[t.name] = np.full(shape, b"surge warm-up", dtype=object)
        elif t.datatype == "BOOL":
            out[t.name] = rng.integers(0, 2, size=shape).astype(bool)
        elif t.datatype.startswith(("INT", "UINT")):
            out[t.name] = rng.integers(0, 2, size=shape).astype(NUMPY_OF[t.datatype])
        else:
            out[t.name] = rng.standard_normal(shape).astype(NUMPY_OF[t.datatype])
    return out


class TensorModelService:
    task = "tensor"

    def __init__(self, name: str, version: str, config: TensorModelConfig, backend: TensorBackend, *,
                 batching: BatchingConfig | None = None, cache: CacheConfig | None = None,
                 limits: LimitsConfig | None = None, metrics_registry: CollectorRegistry | None = None,
                 warm_with_inputs: bool = True):
        self.name, self.version = name, version
        self.kind = config.kind
        self.config = config
        self.backend = backend
        self.batching = batching or BatchingConfig()
        self.cache_cfg = cache or CacheConfig(enabled=False)
        self.limits = limits or LimitsConfig()
        self._ready = False
        self.loaded_at = time.time()
        self.warm_with_inputs = warm_with_inputs
        self.metrics = ServiceMetrics(name, version, metrics_registry)
        b = self.batching
        self._pool = ThreadPoolExecutor(config.instances, thread_name_prefix=f"surge-{name}-tensor")
        self.batcher = DynamicBatcher(
            self._run_batch, self._pool,
            BatcherConfig(enabled=b.enabled and config.batched, max_batch_size=max(1, config.max_batch_size),
                          max_batch_tokens=max(1, config.max_batch_size), max_queue_delay_s=b.max_queue_delay_ms / 1e3,
                          max_queue_size=b.max_queue_size, instances=config.instances, padded=False),
            self.metrics, name)
        c = self.cache_cfg
        self.cache = _TensorCache(c.max_bytes) if c.enabled and c.max_bytes > 0 else None

    # ---- what other code asks of every served model -------------------------------
    @property
    def last_error(self) -> str:
        """The backend's latest failure (a python worker's crash or hang), shown by GET /models."""
        return getattr(self.backend, "last_error", "")

    @property
    def ready(self) -> bool:
        """Loaded and warm, and its backend can run a batch: a python model whose workers are all down
        (their restarts fail) is not ready, as Triton reports a model whose stub died."""
        return self._ready and getattr(self.backend, "available", True)

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value

    @property
    def unavailable_reason(self) -> str:
        """Why a loaded model cannot serve now ("" when it can): the repository index shows it UNAVAILABLE."""
        return getattr(self.backend, "unavailable_reason", "") if self._ready else ""

    def mark_ready(self) -> None:
        self.ready = True

    def cached_result(self, texts, options=None, accept=None):
        return None  # the text hot path has nothing for a tensor model

    async def embed(self, *args, **kwargs):
        raise WrongTask(f"model '{self.name}' serves task 'tensor', not 'embed': call it by tensor name "
                           f"(POST /v2/models/{self.name}/infer)", param="model")

    # ---- inference ------------------------------------------------------------------
    def validate(self, inputs: Outputs, outputs: list[str] | None) -> int:
        """Check a request against the contract; the batch size it carries (1 if unbatched)."""
        cfg = self.config
        usage = "; ".join(t.describe(cfg.batched) for t in cfg.inputs)
        for name in inputs:
            if cfg.input(name) is None:
                raise InvalidInput(f"unexpected input '{name}': model '{self.name}' takes {usage}", param=name)
        rows = None
        for spec in cfg.inputs:
            a = inputs.get(spec.name)
            if a is None:
                if spec.optional:
                    continue
                raise InvalidInput(f"missing input '{spec.name}': model '{self.name}' takes {usage}", param=spec.name)
            got = datatype_of(a)
            if got != spec.datatype:
                raise InvalidInput(f"input '{spec.name}' has datatype {got}, but model '{self.name}' expects "
                                   f"{spec.datatype}", param=spec.name)
            want = spec.full_shape(cfg.batched)
            if len(a.shape) != len(want) or any(w != -1 and w != g for w, g in zip(want, a.shape)):
                raise InvalidInput(f"input '{spec.name}' has shape {list(a.shape)}, but model '{self.name}' expects "
                                   f"{want} (-1: any size)", param=spec.name)
            if cfg.batched:
                n = a.shape[0]
                if n < 1 or n > cfg.max_batch_size:
                    raise InvalidInput(f"input '{spec.name}': batch size {n} is outside 1..{cfg.max_batch_size} "
                                       f"(max_batch_size of model '{self.name}')", param=spec.name)
                if rows is not None and n != rows:
                    raise InvalidInput(f"inputs disagree on the batch size ({rows} and {n} for '{spec.name}')",
                                       param=spec.name)
                rows = n
            if a.dtype == object and not all(isinstance(v, bytes) for v in a.ravel()):
                raise InvalidInput(f"input '{spec.name}': BYTES elements must be bytes", param=spec.name)
        for name in outputs or []:
            if cfg.output(name) is None:
                have = ", ".join(t.name for t in cfg.outputs)
                raise InvalidInput(f"unknown output '{name}': model '{self.name}' has outputs {have}", param=name)
        return rows or 1

    async def infer(self, inputs: Outputs, outputs: list[str] | None = None, *, deadline: float | None = None,
                    priority: int = 0, parameters: dict | None = None, callers: tuple[str, ...] = (),
                    _warmup: bool = False) -> TensorResult:
        """`parameters`: the request's own KServe parameters, handed to a python model's execute.
        `callers`: the python models whose execute waits on this call, outermost first (call-cycle check)."""
        m = self.metrics
        m.requests.inc()
        start = time.monotonic()
        with count_failures(m):
            if not self.ready and not _warmup:
                raise NotReady(f"model {self.name} version {self.version} is not ready"
                               + (f": {self.last_error}" if self.last_error else ""))
            rows = self.validate(inputs, outputs)
            m.inputs.inc(rows)
            wanted = list(outputs or (t.name for t in self.config.outputs))
            # Only a python model sees request parameters and the outputs asked for: a graph's answer
            # depends on neither (it computes every output; the response keeps those asked for).
            python = self.kind == "python"
            keyed = parameters if python else None
            key = self.cache.key(inputs, keyed, wanted if python else None) \
                if self.cache is not None and not _warmup else None
            got = self.cache.get(key) if key is not None else None
            cached = got is not None
            if key is not None:  # the same Prometheus families as the text cache (tier "recent")
                if cached:
                    m.tier("recent")[0].inc()
                else:
                    m.cache_misses.inc()
            timings: dict = {}
            if got is None:
                if deadline is None:
                    deadline = start + self.limits.request_timeout_s
                item = _Item(inputs, rows, dict(parameters or {}), tuple(callers), tuple(wanted))
                got = (await self.batcher.submit([item], deadline, priority, timings))[0]
                if isinstance(got, BaseException):
                    raise got
                if key is not None:
                    self.cache.put(key, got)
                    _, size, entries = m.tier("recent")
                    size.set(self.cache.bytes)
                    entries.set(len(self.cache.entries))
            result = TensorResult({n: got[n] for n in wanted if n in got}, self.name, self.version, rows, [cached],
                                  timings)
            answered(m, time.monotonic() - start)
            return result

    def _run_batch(self, items: list[_Item]) -> np.ndarray:
        results = self.backend.run_requests([it.inputs for it in items], [it.parameters for it in items],
                                            [it.callers for it in items], [it.outputs for it in items])
        out = np.empty(len(items), dtype=object)
        if len(results) != len(items):
            err = EngineError(f"model '{self.name}' returned {len(results)} results for {len(items)} requests")
            results = [err] * len(items)
        for i, r in enumerate(results):
            out[i] = r if isinstance(r, BaseException) else self._check_outputs(r, items[i].rows, items[i].outputs)
        return out

    def _check_outputs(self, got: Outputs, rows: int, asked: tuple[str, ...] = ()) -> Outputs | SurgeError:
        """A backend's outputs against the declared ones (python models can return anything). A python
        model owes only the outputs its request asked for (it may compute no other, as in Triton)."""
        cfg = self.config
        for spec in cfg.outputs:
            if self.kind == "python" and asked and spec.name not in asked:
                continue
            a = got.get(spec.name)
            if a is None:
                return EngineError(f"model '{self.name}' did not return output '{spec.name}'")
            dt = datatype_of(a)
            if dt != spec.datatype:
                return EngineError(f"model '{self.name}' returned output '{spec.name}' as {dt}, but its config "
                                   f"declares {spec.datatype}")
            want = spec.full_shape(cfg.batched)
            if len(a.shape) != len(want) or any(w != -1 and w != g for w, g in zip(want, a.shape)) or (
                    cfg.batched and a.shape[0] != rows):
                shown = [rows if cfg.batched and i == 0 else w for i, w in enumerate(want)]
                return EngineError(f"model '{self.name}' returned output '{spec.name}' with shape {list(a.shape)}, "
                                   f"expected {shown}")
        return got

    async def warmup(self) -> None:
        """Run once through the whole path before traffic (onnx, torch: random inputs of batch 1)."""
        bind = getattr(self.backend, "bind_loop", None)
        if bind is not None:  # a python model's client calls other models on this loop
            bind(asyncio.get_running_loop())
        if not self.warm_with_inputs:
            return
        await self.infer(random_inputs(self.config.inputs, self.config.batched), _warmup=True)

    async def close(self) -> None:
        self.ready = False
        await self.batcher.close()
        self._pool.shutdown(wait=True)
        await asyncio.to_thread(self.backend.close)
        self.metrics.close()


class StackedBackend:
    """run_requests for engines that take one batch (onnx, torch): requests whose
    non-batch dims agree are stacked along dim 0, run at once and split back.
    A failing stack is rerun request by request, so a bad request fails alone."""

    def __init__(self, engine, batched: bool):
        self.engine = engine
        self.batched = batched

    def run_requests(self, requests: list[Outputs], parameters: list[dict] | None = None,
                     callers: list[tuple[str, ...]] | None = None,
                     outputs: list | None = None) -> list[Outputs | SurgeError]:
        results: list = [None] * len(requests)  # a graph takes no request parameters and calls no model
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            sig = tuple(sorted((k, v.shape[1:] if self.batched else v.shape) for k, v in r.items()))
            groups.setdefault(sig if self.batched else (i,), []).append(i)
        for idx in groups.values():
            self._run_group(requests, idx, results)
        return results

    def _run_group(self, requests, idx: list[int], results: list) -> None:
        try:
            if len(idx) == 1:
                results[idx[0]] = self.engine.run(requests[idx[0]])
                return
            feeds = {k: np.concatenate([requests[i][k] for i in idx]) for k in requests[idx[0]]}
            out = self.engine.run(feeds)
            rows = [next(iter(requests[i].values())).shape[0] for i in idx]
            if any(v.ndim == 0 or v.shape[0] != sum(rows) for v in out.values()):
                # An output whose first dim is not the stacked rows (a dynamic dim that is not the batch,
                # e.g. a Compress): its rows cannot be told apart by request, so each runs alone.
                for i in idx:
                    self._run_group(requests, [i], results)
                return
            offset = 0
            for i, n in zip(idx, rows):
                results[i] = {k: v[offset:offset + n] for k, v in out.items()}
                offset += n
        except Exception as exc:  # noqa: BLE001
            if len(idx) > 1:
                for i in idx:
                    self._run_group(requests, [i], results)
                return
            last = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else ""
            results[idx[0]] = exc if isinstance(exc, SurgeError) else EngineError(
                f"inference failed: {type(exc).__name__}: {last}")

    def close(self) -> None:
        self.engine.close()

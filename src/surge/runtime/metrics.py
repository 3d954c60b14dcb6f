"""Prometheus metrics of the serving runtime, labelled per model and version.

Metric families live in a CollectorRegistry that the app exposes on /metrics.
Families are created once per registry (several services, or several apps in
one test process, share them without duplicate-registration errors); each
service gets a `ServiceMetrics` view bound to its (model, version) labels.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_BATCH = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_RATIO = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

_lock = threading.Lock()
_default: CollectorRegistry | None = None
_families: "weakref.WeakKeyDictionary[CollectorRegistry, _Families]" = weakref.WeakKeyDictionary()


def default_registry() -> CollectorRegistry:
    """The process's surge registry (created on first use, not at import)."""
    global _default
    with _lock:
        if _default is None:
            _default = CollectorRegistry()
        return _default


@dataclass
class _Families:
    requests: Counter
    failures: Counter
    inputs: Counter
    dropped: Counter
    latency: Histogram
    queue: Histogram
    tokenize: Histogram
    compute: Histogram
    post: Histogram
    batch_size: Histogram
    batch_tokens: Histogram
    padding: Histogram
    queue_depth: Gauge
    inflight: Gauge
    cache_hits: Counter
    cache_misses: Counter
    cache_evictions: Counter
    coalesced: Counter
    cache_bytes: Gauge
    cache_entries: Gauge
    devices: "_DeviceCollector"
    engines: "_EngineCollector"
    live: dict = field(default_factory=dict)  # (model, version) -> open ServiceMetrics
    # (model, version) -> the cache that writes surge_cache_bytes / _entries under those labels: the
    # routed build's. Two builds of one version (a reload) share the gauge children; without an owner the
    # old cache's values stayed until the new one's first write to each tier.
    cache_owners: dict = field(default_factory=dict)


class _DeviceCollector:
    """Per-device load of replicated engines (runtime/devices.DevicePool), read at scrape time:
    the pool keeps these counts for its least-loaded dispatch already, so serving pays nothing."""

    def __init__(self):
        # labels -> {id of the registering ServiceMetrics: pool}, in registration order: the newest open one is
        # exported, and each copy's close() takes back only its own (a closed build's pool is never kept)
        self.pools: dict[tuple[str, str], dict[int, object]] = {}

    def collect(self):
        mvd = ("model", "version", "device")
        fams = {
            "served_batches": CounterMetricFamily("surge_device_batches", "Engine batches run, by device.", labels=mvd),
            "served_tokens": CounterMetricFamily("surge_device_tokens", "Tokens sent to the engines (padded), by device.",
                                                 labels=mvd),
            "inflight_batches": GaugeMetricFamily("surge_device_inflight_batches", "Batches running now, by device.",
                                                  labels=mvd),
            "instances": GaugeMetricFamily("surge_device_instances", "Engine instances (streams) per device.",
                                           labels=mvd),
        }
        with _lock:
            pools = [(labels, _newest(by)) for labels, by in self.pools.items() if by]
        for labels, pool in pools:
            for st in pool.stats():
                for key, fam in fams.items():
                    fam.add_metric([*labels, st["device"]], st[key])
        yield from fams.values()


class _EngineCollector:
    """Engine shape buckets built (CUDA graphs captured, kernels compiled), read at scrape time.

    phase="serving" counts builds after warm-up: each stalled requests for a capture, so the
    engine builds every bucket before ready and tests keep this at 0 under load."""

    def __init__(self):
        self.engines: dict[tuple[str, str], dict[int, list]] = {}  # as _DeviceCollector.pools

    def collect(self):
        fam = CounterMetricFamily("surge_engine_graph_builds", "Engine shape buckets built (CUDA graph captures "
                                  "with their kernel compilation), by phase: warmup or serving (after ready).",
                                  labels=("model", "version", "phase"))
        secs = CounterMetricFamily("surge_engine_graph_build_seconds", "Time spent building engine shape buckets.",
                                   labels=("model", "version"))
        with _lock:
            items = [(labels, _newest(by)) for labels, by in self.engines.items() if by]
        for labels, engines in items:
            if not engines:
                continue  # a front end under --workers: its engines live in the engine process
            built = sum(getattr(e, "builds", 0) for e in engines)
            after = sum(getattr(e, "builds_after_ready", 0) for e in engines)
            fam.add_metric([*labels, "warmup"], built - after)
            fam.add_metric([*labels, "serving"], after)
            secs.add_metric(list(labels), sum(getattr(e, "build_s", 0.0) for e in engines))
        yield fam
        yield secs


def _newest(registered: dict):
    """The value registered last (dicts keep insertion order)."""
    return next(reversed(registered.values()))


def _take_back(registry: dict, labels: tuple, owner: int) -> None:
    """Drop `owner`'s registration under `labels` (and the labels once none is left)."""
    by = registry.get(labels)
    if by is not None:
        by.pop(owner, None)
        if not by:
            del registry[labels]


def _make(reg: CollectorRegistry) -> _Families:
    mv = ("model", "version")
    return _Families(
        requests=Counter("surge_requests", "Requests received.", mv, registry=reg),
        failures=Counter("surge_request_failures", "Requests that failed, by error code.", (*mv, "code"), registry=reg),
        inputs=Counter("surge_inputs", "Inputs (texts or token lists) received.", mv, registry=reg),
        dropped=Counter("surge_inputs_dropped", "Queued inputs dropped before compute (cancelled, expired).",
                        (*mv, "reason"), registry=reg),
        latency=Histogram("surge_request_latency_seconds", "End-to-end latency inside the runtime.", mv,
                          buckets=_LATENCY, registry=reg),
        queue=Histogram("surge_queue_latency_seconds", "Time an input waited in the batch queue.", mv,
                        buckets=_LATENCY, registry=reg),
        tokenize=Histogram("surge_tokenize_latency_seconds", "Tokenization time per request.", mv,
                           buckets=_LATENCY, registry=reg),
        compute=Histogram("surge_compute_latency_seconds", "Engine time per batch (batch build, run, pooling).", mv,
                          buckets=_LATENCY, registry=reg),
        post=Histogram("surge_postprocess_latency_seconds", "Post-processing time per request.", mv,
                       buckets=_LATENCY, registry=reg),
        batch_size=Histogram("surge_batch_size", "Inputs per engine batch.", mv, buckets=_BATCH, registry=reg),
        batch_tokens=Histogram("surge_batch_tokens", "Tokens per engine batch (padded for padded engines).", mv,
                               buckets=_TOKENS, registry=reg),
        padding=Histogram("surge_batch_padding_ratio", "Share of a batch's tokens that are padding.", mv,
                          buckets=_RATIO, registry=reg),
        queue_depth=Gauge("surge_queue_depth", "Inputs waiting in the batch queue.", mv, registry=reg, multiprocess_mode="livesum"),
        inflight=Gauge("surge_inflight_inputs", "Inputs admitted and not yet answered.", mv, registry=reg, multiprocess_mode="livesum"),
        cache_hits=Counter("surge_cache_hits", "Cache hits, by tier.", (*mv, "tier"), registry=reg),
        cache_misses=Counter("surge_cache_misses", "Cache misses (every tier missed).", mv, registry=reg),
        cache_evictions=Counter("surge_cache_evictions", "Entries evicted from the recent tier.", mv, registry=reg),
        coalesced=Counter("surge_inputs_coalesced", "Missed inputs answered by an identical input's computation "
                          "already in flight.", mv, registry=reg),
        cache_bytes=Gauge("surge_cache_bytes", "Bytes held by the cache, by tier.", (*mv, "tier"), registry=reg, multiprocess_mode="livesum"),
        cache_entries=Gauge("surge_cache_entries", "Entries held by the cache, by tier.", (*mv, "tier"), registry=reg, multiprocess_mode="livesum"),
        devices=_register(reg, _DeviceCollector()),
        engines=_register(reg, _EngineCollector()),
    )


def multiprocess_dir() -> str | None:
    """PROMETHEUS_MULTIPROC_DIR under `--workers` (the supervisor sets it for its children)."""
    import os

    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def process_gone(pid: int) -> None:
    """Under `--workers`: process `pid` (a child of this one) ended, so its live gauges leave the sums.
    `livesum` / `livemax` hold only if whoever starts a process does this when it ends: otherwise a
    dead engine's last values (running sequences, KV cache use) stay on /metrics for good. Idempotent."""
    if not multiprocess_dir():
        return
    try:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
    except Exception:  # noqa: BLE001 - metrics must never take a supervisor down
        import logging

        logging.getLogger("surge").exception("metrics: removing the gauges of process %d", pid)


class WholeRegistry:
    """/metrics under `--workers`: every process's counters, histograms and gauges (prometheus_client's
    multiprocess files: counters and histograms summed over processes, gauges summed over live ones),
    plus this process's collectors that read live objects (GPU, devices)."""

    def __init__(self, path: str, extra: list):
        self.path = path
        self.extra = [c for c in extra if c is not None]

    def register(self, collector) -> None:
        """Collectors of this process added later (e.g. process_* metrics): exported as they are."""
        self.extra.append(collector)

    def unregister(self, collector) -> None:
        self.extra = [c for c in self.extra if c is not collector]

    def collect(self):
        from prometheus_client.multiprocess import MultiProcessCollector

        reg = CollectorRegistry()
        MultiProcessCollector(reg, self.path)
        yield from reg.collect()
        for c in self.extra:
            yield from c.collect()


def _register(reg: CollectorRegistry, collector):
    reg.register(collector)
    return collector


def families(reg: CollectorRegistry) -> _Families:
    with _lock:
        fam = _families.get(reg)
        if fam is None:
            fam = _families[reg] = _make(reg)
        return fam


class NoCount:
    """Stands in for a counter or histogram child while ServiceMetrics.quiet() (or GenerateMetrics.quiet())."""

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass


class RequestCounts:
    """A model version's requests, failures by code and end-to-end latency, in the families every served
    model reports them in, for a kind whose other metrics are its own (generation:
    runtime/generate_metrics.py): one dashboard's request and error rates then cover every model."""

    def __init__(self, model: str, version: str, registry: CollectorRegistry | None = None):
        f = self.fam = families(registry or default_registry())
        self.labels = (model, version)
        self.requests = f.requests.labels(model, version)
        self.latency = f.latency.labels(model, version)

    def failure(self, code: str) -> None:
        self.fam.failures.labels(*self.labels, code).inc()


class ServiceMetrics:
    """One model version's children of every family (label lookups done once)."""

    def __init__(self, model: str, version: str, registry: CollectorRegistry | None = None):
        self.registry = registry or default_registry()
        self.labels = (model, version)
        f = self.fam = families(self.registry)
        lv = self.labels
        self.requests = f.requests.labels(*lv)
        self.inputs = f.inputs.labels(*lv)
        self.latency = f.latency.labels(*lv)
        self.queue = f.queue.labels(*lv)
        self.tokenize = f.tokenize.labels(*lv)
        self.compute = f.compute.labels(*lv)
        self.post = f.post.labels(*lv)
        self.batch_size = f.batch_size.labels(*lv)
        self.batch_tokens = f.batch_tokens.labels(*lv)
        self.padding = f.padding.labels(*lv)
        self.queue_depth = f.queue_depth.labels(*lv)
        self.inflight = f.inflight.labels(*lv)
        self.cache_misses = f.cache_misses.labels(*lv)
        self.cache_evictions = f.cache_evictions.labels(*lv)
        self.coalesced = f.coalesced.labels(*lv)
        if multiprocess_dir():
            # Multiprocess files: a request's own series are written once per loop pass
            # (runtime/metrics_buffer.py), not ~10 mmap writes per request.
            from surge.runtime.metrics_buffer import BufferedCounter, BufferedHistogram

            self.requests, self.inputs, self.inflight = (BufferedCounter(c) for c in
                                                         (self.requests, self.inputs, self.inflight))
            self.latency, self.tokenize, self.post = (BufferedHistogram(h) for h in
                                                      (self.latency, self.tokenize, self.post))
        self._tiers: dict[str, tuple] = {}
        self._quiet = False
        self._cache = None  # the cache this build claimed the gauges for (claim_cache)
        with _lock:
            f.live[lv] = f.live.get(lv, 0) + 1
        self._closed = False

    def failure(self, code: str) -> None:
        if self._quiet:
            return
        self.fam.failures.labels(*self.labels, code).inc()

    # what a request moves: quiet() silences them all (the engine's own series, graph builds by phase, stay)
    _TRAFFIC = ("requests", "inputs", "latency", "queue", "tokenize", "compute", "post", "batch_size",
                "batch_tokens", "padding", "cache_misses", "cache_evictions", "coalesced")

    @contextlib.contextmanager
    def quiet(self):
        """Nothing a request moves is counted inside (a load's warm-up call: no client sent it, and its
        cold first-run latency is no client's): requests, inputs, failures, latencies, batches, cache hits
        and misses; and `is_quiet` tells the service to leave its cache alone (the warm-up's text in it
        would show as an entry before any traffic). Only for a copy no traffic reaches yet: the series are
        shared with any other copy under the same labels, this switch is not."""
        kept = {name: getattr(self, name) for name in self._TRAFFIC}
        for name in self._TRAFFIC:
            setattr(self, name, NoCount())
        self._quiet = True
        try:
            yield
        finally:
            for name, child in kept.items():
                setattr(self, name, child)
            self._quiet = False

    @property
    def is_quiet(self) -> bool:
        return self._quiet

    def claim_cache(self, cache) -> None:
        """`cache` (this build's, now routed) alone writes the cache gauges under these labels from now
        on; the caller then writes its state. A replaced build's cache, drained after the switch, writes
        nothing more."""
        with _lock:
            self.fam.cache_owners[self.labels] = cache
        self._cache = cache

    def owns_cache(self, cache) -> bool:
        """Whether `cache` may write the cache gauges: it owns them, or no routed build claimed them yet."""
        owner = self.fam.cache_owners.get(self.labels)
        return owner is None or owner is cache

    def dropped(self, reason: str, n: int = 1) -> None:
        self.fam.dropped.labels(*self.labels, reason).inc(n)

    def tier(self, tier: str):
        """(hits counter, bytes gauge, entries gauge) of one cache tier (the hits not counted while quiet)."""
        t = self._tiers.get(tier)
        if t is None:
            f, lv = self.fam, self.labels
            t = self._tiers[tier] = (f.cache_hits.labels(*lv, tier), f.cache_bytes.labels(*lv, tier),
                                     f.cache_entries.labels(*lv, tier))
        return (NoCount(), *t[1:]) if self._quiet else t

    def watch_devices(self, pool) -> None:
        """Export a DevicePool's per-device counts under this version's labels until close()."""
        with _lock:
            self.fam.devices.pools.setdefault(self.labels, {})[id(self)] = pool

    def watch_engines(self, engines: list) -> None:
        """Export the engines' bucket-build counts (surge_engine_graph_builds) until close()."""
        with _lock:
            self.fam.engines.engines.setdefault(self.labels, {})[id(self)] = list(engines)

    def close(self) -> None:
        """A retired version holds nothing: zero its gauges. Its series are
        kept (not removed): a reloaded version with the same labels shares
        these children, and removing them would silently detach it."""
        if self._closed:
            return
        self._closed = True
        with _lock:
            left = self.fam.live[self.labels] = self.fam.live[self.labels] - 1
            if self._cache is not None and self.fam.cache_owners.get(self.labels) is self._cache:
                del self.fam.cache_owners[self.labels]  # nor does it keep the cache alive
            self._cache = None  # the cache holds these metrics: no cycle left to keep a retired build
            # its own engines and pool only, whatever else is open under these labels: before, they stayed
            # exported (and alive) while another copy was open, e.g. a same-named model elsewhere in the process
            _take_back(self.fam.devices.pools, self.labels, id(self))
            _take_back(self.fam.engines.engines, self.labels, id(self))
        if left:
            return  # another open service reports under these labels
        self.queue_depth.set(0)
        self.inflight.set(0)
        for _, g_bytes, g_entries in self._tiers.values():
            g_bytes.set(0)
            g_entries.set(0)

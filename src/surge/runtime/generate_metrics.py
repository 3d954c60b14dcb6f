"""Prometheus metrics of generation, per model and version, on the runtime's registry."""

from __future__ import annotations

import contextlib
import threading
import weakref
from bisect import bisect_left
from collections import Counter as _Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from surge.runtime.metrics import NoCount, RequestCounts, default_registry

_TTFT = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_ITL = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
INF = float("inf")
_lock = threading.Lock()
_families: "weakref.WeakKeyDictionary[CollectorRegistry, dict]" = weakref.WeakKeyDictionary()


def _make(registry: CollectorRegistry) -> dict:
    labels = ("model", "version")
    return {
        "ttft": Histogram("surge_generate_time_to_first_token_seconds", "Time to first token.", labels,
                          buckets=_TTFT, registry=registry),
        "itl": Histogram("surge_generate_inter_token_latency_seconds", "Time between output tokens of a stream.",
                         labels, buckets=_ITL, registry=registry),
        "output": Counter("surge_generate_output_tokens", "Output tokens generated (rate: tokens/s).", labels,
                          registry=registry),
        "prompt": Counter("surge_generate_prompt_tokens", "Prompt tokens received.", labels, registry=registry),
        "requests": Counter("surge_generate_requests", "Generation requests by finish reason.",
                            (*labels, "finish_reason"), registry=registry),
        # engine-wide: under --workers set by the engine process alone (runtime/generate_hub.py), the
        # front ends' copies stay 0; one series, the live processes' largest
        "running": Gauge("surge_generate_running_sequences", "Sequences in the running batch.", labels,
                         registry=registry, multiprocess_mode="livemax"),
        "waiting": Gauge("surge_generate_waiting_sequences", "Sequences waiting for KV blocks.", labels,
                         registry=registry, multiprocess_mode="livemax"),
        "kv": Gauge("surge_generate_kv_cache_usage_ratio", "Share of KV cache blocks in use.", labels,
                    registry=registry, multiprocess_mode="livemax"),
        "prefix_queried": Counter("surge_generate_prefix_cache_queried_tokens",
                                  "Prompt tokens looked up in the prefix cache.", labels, registry=registry),
        "prefix_hit": Counter("surge_generate_prefix_cache_hit_tokens",
                              "Prompt tokens found in the prefix cache (hit rate: hit / queried).", labels,
                              registry=registry),
        "preempt": Counter("surge_generate_preemptions", "Sequences preempted for KV blocks.", labels,
                           registry=registry),
        "retries": Counter("surge_generate_step_retries", "Sequences of a failed generation step run again alone "
                           "(the step's other requests are not failed with the one at fault).", labels,
                           registry=registry),
        "drafted": Counter("surge_generate_spec_draft_tokens", "Draft tokens checked by speculative decoding.",
                           labels, registry=registry),
        "accepted": Counter("surge_generate_spec_accepted_tokens", "Draft tokens the model agreed with (acceptance "
                            "rate: accepted / draft).", labels, registry=registry),
        "cache_hits": Counter("surge_generate_cache_hits", "Requests answered from the generation cache.", labels,
                              registry=registry),
        "restarts": Counter("surge_generate_engine_restarts", "Engine processes started again after one exited.",
                            labels, registry=registry),
        "lora": Counter("surge_generate_lora_requests", "Generation requests by LoRA adapter (the model label: "
                        "the base model).", (*labels, "adapter"), registry=registry),
    }


class GenerateMetrics:
    def __init__(self, model: str, version: str, registry: CollectorRegistry | None = None):
        registry = registry or default_registry()
        with _lock:
            fam = _families.get(registry)
            if fam is None:
                fam = _families[registry] = _make(registry)
        lab = {"model": model, "version": version}
        self.ttft = fam["ttft"].labels(**lab)
        self.itl = fam["itl"].labels(**lab)
        self.output = fam["output"].labels(**lab)
        self.prompt = fam["prompt"].labels(**lab)
        self._requests = fam["requests"]
        self._lora = fam["lora"]
        self._lab = lab
        self.running = fam["running"].labels(**lab)
        self.waiting = fam["waiting"].labels(**lab)
        self.kv = fam["kv"].labels(**lab)
        self.prefix_queried = fam["prefix_queried"].labels(**lab)
        self.prefix_hit = fam["prefix_hit"].labels(**lab)
        self.preempt = fam["preempt"].labels(**lab)
        self.retries = fam["retries"].labels(**lab)
        self.cache_hits = fam["cache_hits"].labels(**lab)
        self.drafted = fam["drafted"].labels(**lab)
        self.accepted = fam["accepted"].labels(**lab)
        self.restarts = fam["restarts"].labels(**lab)
        # requests, failures by code, latency: counted per generation by the routes (server/http/generate_common.py)
        self.outcome = RequestCounts(model, version, registry)
        self._seen = (0, 0, 0, 0, 0, 0)
        self._gauges: tuple | None = None
        self._quiet = False

    @contextlib.contextmanager
    def quiet(self):
        """No generation request, prompt or output token, TTFT or inter-token gap counted inside (a load's
        warm-up generation: no client sent it, and its cold first-run latency is no client's), as
        ServiceMetrics.quiet() does for the other kinds. Only for a copy no traffic reaches yet: the series
        are shared with any other copy under the same labels (a same-version reload), this switch is not.
        The engine-wide gauges and the prefix cache's and preemption counters still count: that work was
        done, and the engine state reports it."""
        kept = self.ttft, self.itl, self.output, self.prompt, self.cache_hits
        self.ttft = self.itl = self.output = self.prompt = self.cache_hits = NoCount()
        self._quiet = True
        try:
            yield
        finally:
            self.ttft, self.itl, self.output, self.prompt, self.cache_hits = kept
            self._quiet = False

    def observe_itl(self, values: list[float]) -> None:
        """Many inter-token gaps at once: one increment per bucket touched and one of the sum
        (the same counts as observe() per value), through the histogram child's value cells where
        this prometheus_client has them, else observe() per value."""
        if self._quiet:
            return
        h = self.itl
        bounds, cells, total = (getattr(h, "_upper_bounds", None), getattr(h, "_buckets", None),
                                getattr(h, "_sum", None))
        if bounds is None or cells is None or total is None or len(bounds) != len(cells) or bounds[-1] != INF:
            for v in values:
                h.observe(v)
            return
        counts: dict[int, int] = {}
        # one engine step's gaps are mostly the same value (every stream delivered at the same time)
        for v, c in _Tally(values).items():
            i = bisect_left(bounds, v)  # the first bucket with v <= bound, as observe() picks it
            counts[i] = counts.get(i, 0) + c
        total.inc(sum(values))
        for i, c in counts.items():
            cells[i].inc(c)

    def finished(self, reason: str) -> None:
        if self._quiet:
            return
        self._requests.labels(**self._lab, finish_reason=reason).inc()

    def lora_request(self, adapter: str) -> None:
        if self._quiet:
            return
        self._lora.labels(**self._lab, adapter=adapter).inc()

    def forget_adapter(self, adapter: str) -> None:
        """An adapter was unloaded: its series goes (names loaded at run time are the clients' choice; kept,
        every name ever used stayed on /metrics). A request that started before the unload was counted then."""
        with contextlib.suppress(KeyError):  # never asked for
            self._lora.remove(self._lab["model"], self._lab["version"], adapter)

    def engine_state(self, state) -> None:
        """After an iteration of the engine loop (runtime/generate_core.EngineState): gauges and the
        prefix cache's counters, each set only when it changed (a set takes a lock; most iterations
        change none)."""
        gauges = (state.running, state.waiting, state.free_blocks)
        if gauges != self._gauges:
            self._gauges = gauges
            self.running.set(state.running)
            self.waiting.set(state.waiting)
            self.kv.set(state.kv_usage)
        seen = (state.prefix_queried_tokens, state.prefix_hit_tokens, state.preemptions,
                getattr(state, "draft_tokens", 0), getattr(state, "accepted_tokens", 0),
                getattr(state, "step_retries", 0))
        for counter, now, before in zip((self.prefix_queried, self.prefix_hit, self.preempt, self.drafted,
                                         self.accepted, self.retries), seen, self._seen):
            if now > before:
                counter.inc(now - before)
        self._seen = seen

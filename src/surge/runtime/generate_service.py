"""The async face of one served decoder model: generate and stream.

Requests become Sequences handed to the engine loop (runtime/generate_core.EngineLoop: schedule ->
engine step -> update), which runs on a thread of this process or, with
GenerationConfig.engine_process (the default), in a process of its own
(runtime/generate_process.py). Each iteration's sampled tokens come back to the event loop in one
call, which detokenizes, applies stop strings, counts the metrics and builds every stream's delta in
one pass; a request's own coroutine is only woken to yield its delta. A request that ends early
(client gone, deadline, stop string) aborts its sequence: the engine loop frees its KV blocks before
its next step. Greedy and seeded requests are answered from a bounded cache of finished generations
(keyed by version, prompt ids and parameters), streamed as they were first streamed.
The per-token work on the event loop is runtime/generate_streams.py; restarting an engine process
that exits, runtime/generate_restart.py (mixins of GenerateService).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import AsyncIterator


from surge.config import GenerationConfig  # noqa: F401  (re-exported: callers build it from here)
from surge.errors import NotFound, NotReady, Overloaded, WrongTask
from surge.models.decoder import checkpoint_architecture, sampling_defaults
from surge.runtime.detok import TextState
from surge.runtime.generate_core import EngineLoop, EngineState, ThreadChannel
from surge.runtime.generate_delta import Delta, GenerationResult
from surge.runtime.generate_metrics import GenerateMetrics
from surge.runtime.generate_shared import attach_shared_cache, pack, shared_key, unpack, weights_fingerprint  # noqa: F401
from surge.runtime.generate_sizes import INT_BYTES, deltas_bytes, params_bytes
from surge.runtime.generate_lora import LoraHost
from surge.runtime.generate_restart import EngineRestarts
from surge.runtime.generate_streams import StreamDelivery, _error, _Handle, _ThreadOutbox
from surge.runtime.generate_text import PromptText
from surge.runtime.off_loop import off_loop
from surge.runtime.scheduler import SamplingParams, Sequence


# SamplingParams.bulk above which stream's checks, cache key and engine message are made on a thread: at
# ~1 us an item of Python work, a millisecond of the event loop
BULK = 1024


class GenerateService(StreamDelivery, EngineRestarts, LoraHost, PromptText):
    task = "generate"
    kind = "hf"

    def __init__(self, name: str, version: str, path: Path, engine, tokenizer, chat_template=None,
                 config: GenerationConfig | None = None, request_timeout_s: float = 30.0, metrics_registry=None):
        self.name = name
        self.version = version
        self.path = Path(path)
        self.engine = engine
        self.tokenizer = tokenizer  # tokenizers.Tokenizer
        self.chat_template = chat_template
        self.config = (config or GenerationConfig()).resolved()
        # what a request that leaves sampling fields unset gets (server/http/generate_common.make_params)
        self.sampling_defaults = {} if self.config.generation_config == "none" else sampling_defaults(self.path)
        self.architecture = checkpoint_architecture(self.path)  # TEI's /info `architecture`
        self.request_timeout_s = request_timeout_s
        self.ready = False
        self.loaded_at = time.time()
        caps = engine.capabilities
        self.max_model_len = caps.max_model_len
        self.vocab_size = engine.cfg.vocab_size
        self.metrics = GenerateMetrics(name, version, metrics_registry)
        self._ids = itertools.count(1)
        self._closed = False
        self._restarting = False  # a new engine process is being started (remote)
        self._restart_task: asyncio.Task | None = None
        self._restarts: list[float] = []  # when the engine process was started again (monotonic)
        self._sent = 0  # sequences sent to the engine loop (its state's `received` counts those it took)
        self._state = EngineState()
        self._arrivals: list[Sequence] = []  # submitted during this event-loop pass (event loop only)
        self._handles: dict[int, _Handle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        # the generation cache: key -> (deltas, about the bytes of key and deltas), bounded by cache_entries
        # and cache_bytes (what a request's fields make an entry hold is the client's choice)
        self._cache: OrderedDict[tuple, tuple[list[Delta], int]] = OrderedDict()
        self._cache_bytes = 0
        # the generation cache's shared tier (runtime/cache_redis.RedisTier; attach_shared_cache): replicas
        # and --workers front ends of one version answer each other's repeats
        self.shared = None
        self._puts: set[asyncio.Task] = set()
        # the engine loop runs elsewhere (runtime/generate_process.EngineProcess, generate_hub.HubClient)
        self.remote = bool(getattr(engine, "remote", False))
        # engine-wide gauges and counters (KV use, prefix cache, preemptions) are this process's to
        # export, unless the engine's own process exports them (several front ends share it)
        self._engine_metrics = getattr(engine, "engine_metrics", True)
        # LoRA adapters by name (runtime/lora_adapters.py), and their views, which the registry serves
        self.adapters: dict = {}
        self.views: list = []
        if self.remote:
            # the engine loop runs in the child; its scheduler and step loop are not in this process
            self.core = self.scheduler = self.loop = None
            self._channel = None
            self._start_adapters()
            return
        self.core = EngineLoop(engine, self.config, name)
        self.scheduler, self.loop = self.core.scheduler, self.core.loop  # what tests and benchmarks inspect
        self._channel = ThreadChannel()
        # The engine thread gives up the GIL at every device sync and wake-up; with the default 5 ms
        # switch interval it can then wait that long behind the event loop's per-token work, which is a
        # decode step's whole budget. A shorter interval bounds that wait (process-wide, cheap).
        if sys.getswitchinterval() > 0.0005:
            sys.setswitchinterval(0.0005)
        self._thread = threading.Thread(target=self.core.run, args=(self._channel, _ThreadOutbox(self)),
                                        name=f"surge-{name}-generate", daemon=True)
        self._thread.start()
        self._start_adapters()

    @property
    def steps(self) -> int:
        return self._state.steps

    @property
    def inflight(self) -> int:
        """Streams and generations under way."""
        return len(self._handles)

    @property
    def busy_s(self) -> float:
        """Time the engine loop spent inside its steps (schedule, launch, read back, resolve)."""
        return self._state.busy_s

    # -- what the protocol layers use --------------------------------------------------------------------
    @property
    def spec(self):
        return self.engine.cfg

    def mark_ready(self) -> None:
        self.ready = True

    def kserve_metadata(self, versions: list[str]) -> dict:
        """KServe model metadata: the generate extension's tensors (Triton's names)."""
        caps = self.engine.capabilities
        return {"name": self.name, "versions": versions, "platform": f"surge_{caps.device}", "task": self.task,
                "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1]}],
                "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [1]}]}

    async def warmup_request(self) -> None:
        """One short generation through the whole path (the repository calls it before traffic), not
        counted on /metrics: no client sent it (as ServedModel.warmup for the other kinds)."""
        prompt = self.encode("surge warm-up") or [0]
        with self.metrics.quiet():
            await self.generate(prompt[: max(1, self.max_model_len // 2)],
                                SamplingParams(max_tokens=2, temperature=0.7, ignore_eos=True))

    async def embed(self, *args, **kwargs):
        raise WrongTask(f"model '{self.name}' serves task 'generate', not 'embed'", param="model")

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       deadline: float | None = None, use_cache: bool = True,
                       adapter: str | None = None, queue_limit: bool = True) -> GenerationResult:
        text, ids, logprobs, last, prompt_lps = [], [], [], None, None
        async for d in self.stream(prompt_ids, params, deadline=deadline, use_cache=use_cache, adapter=adapter,
                                   queue_limit=queue_limit):
            if prompt_lps is None:
                prompt_lps = d.prompt_logprobs
            text.append(d.text)
            ids.extend(d.token_ids)
            if d.logprobs:
                logprobs.extend(d.logprobs)
            last = d
        return GenerationResult("".join(text), ids, last.finish_reason, last.prompt_tokens, last.completion_tokens,
                                logprobs if params.logprobs is not None else None, last.cached, last.timings,
                                prompt_lps, last.stop_reason, last.cached_tokens)

    async def stream(self, prompt_ids: list[int], params: SamplingParams, *,
                     deadline: float | None = None, use_cache: bool = True,
                     adapter: str | None = None, queue_limit: bool = True) -> AsyncIterator[Delta]:
        """Deltas of text and tokens; the last one has finish_reason and the token counts.
        `use_cache=False`: computed even when cached (a health probe must reach the engine);
        `adapter`: the name of a loaded LoRA adapter to generate with (NotFound otherwise);
        `queue_limit=False`: never refused by `max_waiting` (a health probe: refused when clients
        fill the queue, it would report a busy engine as a dead one)."""
        if not self.ready or self._closed:
            raise NotReady(f"model '{self.name}' is not ready")
        lora = None
        if adapter is not None:
            lora = self.adapters.get(adapter)
            if lora is None:
                raise NotFound(f"LoRA adapter '{adapter}' of model '{self.name}' is not loaded", param="model")
            self.metrics.lora_request(adapter)
        self.check_prompt(prompt_ids, params.max_tokens if params.own_max_tokens else None)
        keyed = use_cache and params.deterministic and self.config.cache_entries and self.config.cache_bytes
        if params.bulk > BULK:  # hundreds of thousands of bad words, a grammar of MBs: not on the event loop
            pkey = await off_loop(self._checked, params, keyed)
        else:
            pkey = self._checked(params, keyed)
        if pkey is not None:
            pkey, key_bytes = pkey
            key_bytes += INT_BYTES * len(prompt_ids)
        deadline = deadline or time.monotonic() + self.request_timeout_s
        # an adapter's answers are its own: its digest joins the version in the cache's key
        version = self.version if lora is None else f"{self.version}+lora:{lora.digest}"
        key = (version, tuple(prompt_ids), pkey) if keyed else None
        if key is not None and key not in self._cache and self.shared is not None:
            found = unpack(await self.shared.get_bytes(shared_key(key)))
            if found is not None:
                self._remember(key, key_bytes, found, share=False)
        if key is not None and key in self._cache:
            self._cache.move_to_end(key)
            self.metrics.cache_hits.inc()
            kept = self._cache[key][0]
            # finished for its client as a computed answer does: counted by its reason, as _deliver counts those
            self.metrics.finished(kept[-1].finish_reason)
            for d in kept:
                yield Delta(d.text, d.token_ids, d.logprobs, d.finish_reason, d.prompt_tokens, d.completion_tokens,
                            cached=True, prompt_logprobs=d.prompt_logprobs, stop_reason=d.stop_reason,
                            cached_tokens=d.prompt_tokens if d.finish_reason is not None else 0)
            return
        if not self.ready or self._closed:  # unloaded, or its engine process died, during the lookup above
            raise NotReady(f"model '{self.name}' is not ready")
        if queue_limit and self._queued() >= self.config.max_waiting:
            raise Overloaded(f"model '{self.name}': {self.config.max_waiting} requests already wait for KV cache "
                             "space", retry_after=1.0)
        loop = self._loop
        if loop is None:
            loop = self.bind_loop(asyncio.get_running_loop())
        start = time.monotonic()
        seq = Sequence(next(self._ids), list(prompt_ids), params, start)
        if lora is not None:
            seq.adapter_uid = lora.uid  # the engine loop gives it a slot at admission
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                    else frozenset(self.engine.cfg.eos_token_ids))
        handle = _Handle(seq, TextState(self.decode if params.skip_special_tokens else self.decode_all, params.stop,
                                           params.min_tokens, params.include_stop_str_in_output), stops, start)
        self._handles[seq.seq_id] = handle
        self._arrive(seq)
        self.metrics.prompt.inc(len(prompt_ids))
        recorded: list[Delta] = []
        timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), self._expire, handle)
        try:
            while True:
                while handle.delta is None and handle.error is None:
                    handle.waiter = loop.create_future()
                    await handle.waiter
                d = handle.delta
                if d is None:
                    raise handle.error
                handle.delta = None
                if key is not None:
                    recorded.append(d)
                if d.finish_reason is not None:
                    # counted and cached before the last delta is handed out: a consumer may stop
                    # iterating (and close this generator) as soon as it sees the finish reason
                    if key is not None:
                        self._remember(key, key_bytes, recorded)
                    yield d
                    return
                yield d
        finally:
            timer.cancel()
            if not handle.done:
                handle.done = True
                self._abort(handle, "abort")
                self.metrics.finished("abort")
            self._handles.pop(seq.seq_id, None)

    def _checked(self, params: SamplingParams, keyed: bool) -> tuple | None:
        """The checks and work of `stream` that grow with its params: the guide compiles (the routes check
        it first, naming the field it came in; one over 64 KiB is not kept compiled), the cache key (when
        `keyed`: with about the bytes its request-sized fields take), and for the engine process the pickled
        params (SamplingParams.pack)."""
        self.check_guide(params.guide)
        if self.remote and params.bulk > BULK:
            params.pack()
        return (params.key(), params_bytes(params)) if keyed else None

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        """The event loop that streams through this service (its first stream's, or given here first);
        a remote engine's messages are read on it from now on. A front end under --workers binds it at
        start: the shared engine loop reports its state to every front end, streaming or not."""
        if self._loop is None:
            self._loop = loop
            if self.remote:
                self.engine.attach(loop, self._on_message, self._on_exit)
        return self._loop

    def _queued(self) -> int:
        """Sequences waiting for KV space as of the engine loop's last report, plus those sent or
        submitted since that it has not taken in yet."""
        return self._state.waiting + self._sent - self._state.received + len(self._arrivals)

    def _remember(self, key, key_bytes: int, deltas: list[Delta], share: bool = True) -> None:
        """Keep a finished generation (`key_bytes`: about what its key takes), the least recently used ones
        going past cache_entries or cache_bytes; one larger than cache_bytes is not kept."""
        size = key_bytes + deltas_bytes(deltas)
        if size <= self.config.cache_bytes:
            old = self._cache.pop(key, None)
            if old is not None:
                self._cache_bytes -= old[1]
            self._cache[key] = (deltas, size)
            self._cache_bytes += size
            while len(self._cache) > self.config.cache_entries or self._cache_bytes > self.config.cache_bytes:
                self._cache_bytes -= self._cache.popitem(last=False)[1][1]
        if share and self.shared is not None:
            task = asyncio.ensure_future(self.shared.put_bytes(shared_key(key), pack(deltas)))
            self._puts.add(task)  # held until done (the loop keeps only weak references)
            task.add_done_callback(self._puts.discard)

    def _arrive(self, seq: Sequence) -> None:
        # The requests submitted in one pass of the event loop (a client's gather, one read of many
        # HTTP requests) reach the engine thread together, at the pass's end: an idle engine thread
        # woken by the first would otherwise start a prefill step with whatever had arrived by the time
        # it got the GIL, and the rest would wait that whole step for theirs (session 16: 64 prompts
        # submitted at once were prefilled in two steps of 30 and 34, 13-28 ms each, before any
        # decoding). Costs a lone request one callback's delay.
        self._arrivals.append(seq)
        if len(self._arrivals) == 1:
            asyncio.get_running_loop().call_soon(self._admit_arrivals)

    def _admit_arrivals(self) -> None:
        seqs, self._arrivals = self._arrivals, []
        if seqs:
            self._sent += len(seqs)
            self._send(("add", seqs))

    def _abort(self, handle: _Handle, reason: str) -> None:
        seq = handle.seq
        for i, s in enumerate(self._arrivals):
            if s is seq:  # gone before its pass ended: it never reaches the engine
                del self._arrivals[i]
                return
        self._send(("abort", seq.seq_id, reason))

    def _send(self, msg) -> None:
        if self.remote:
            if not self.engine.send(msg) and self._loop is not None and not self._restarting:
                self._loop.call_soon(self._on_exit)  # the child is gone: fail now, not at the deadline
        else:
            self._channel.put(msg)

    def stats(self) -> dict:
        st = self._state
        return {"running": st.running, "waiting": st.waiting, "kv_usage": st.kv_usage,
                "free_blocks": st.free_blocks, "prefix_hit_tokens": st.prefix_hit_tokens,
                "prefix_queried_tokens": st.prefix_queried_tokens, "preemptions": st.preemptions,
                "steps": st.steps, "overlapped_steps": st.overlapped_steps,
                "speculative_steps": st.spec_steps, "draft_tokens": st.draft_tokens,
                "accepted_tokens": st.accepted_tokens, "step_retries": st.step_retries,
                "engine_process": self.engine.pid if self.remote else None}

    async def close(self) -> None:
        self.ready = False
        self._closed = True
        if self.remote:
            self.engine.send(("close",))
            # meanwhile this loop reads the child's last messages (its streams' "unloaded" errors)
            await asyncio.to_thread(self.engine.exit_code, 10.0)
            self.engine.stop()
            # what the child could not report (it died, or its last message was not read before the stop)
            self._fail_streams(NotReady(f"model '{self.name}' was unloaded"))
            if self._restart_task is not None:  # a child being started: closed as soon as it is up
                await asyncio.wait({self._restart_task}, timeout=60)
        else:
            self._admit_arrivals()  # this pass's submissions before the close: they end as unloaded
            self._channel.put(("close",))
            await asyncio.to_thread(self._thread.join, 10.0)
            # what the engine thread did not take in before it stopped
            self._fail_streams(NotReady(f"model '{self.name}' was unloaded"))

    # -- what the engine loop reports (its thread, or this process's reader of the engine process) -------
    def _set_state(self, state: EngineState) -> None:
        self._state = state
        if self._engine_metrics:
            self.metrics.engine_state(state)

    def _on_message(self, msg) -> None:
        """A message of the engine process (read on the event loop)."""
        kind = msg[0]
        if kind == "tokens":
            self._set_state(msg[3])
            self._deliver(msg[1], msg[2])
        elif kind == "error":
            self._fail(msg[1], _error(msg[2], msg[3]))
        elif kind == "state":
            self._set_state(msg[1])


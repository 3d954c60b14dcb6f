"""The engine side of a served decoder: the iteration loop (schedule -> engine step -> update).

`EngineLoop` owns the scheduler, the step loop and the engine. It takes messages (sequences to add,
sequence ids to abort, close) from a channel and reports through an outbox: each iteration's tokens,
a request's failure, the engine's state for the metrics. The same loop runs on a thread of the
server process (`ThreadChannel`; GenerateService's default on the CPU) or alone in a process of its
own (runtime/generate_process.py; the default on a GPU), where it never waits for the GIL of the
event loop that parses requests and writes the streams.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

from surge.runtime.guided import MAX_FORCED_BYTES
from surge.runtime.scheduler import Scheduler, SchedulerConfig, SeqStatus, Sequence
from surge.runtime.scheduler.adapters import PENDING, AdapterSlots
from surge.runtime.scheduler.draft_model import DraftModelProposer
from surge.runtime.scheduler.ngram import NgramProposer
from surge.runtime.scheduler.overlap import StepLoop

log = logging.getLogger("surge.generate")

# the kinds of a failed request, rebuilt as surge errors on the service's side (runtime/generate_service.py)
INVALID, ENGINE, UNLOADED = "invalid", "engine", "unloaded"


@dataclass(frozen=True)
class EngineState:
    """What the metrics and `stats()` read, after an iteration."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    kv_usage: float = 0.0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    overlapped_steps: int = 0
    busy_s: float = 0.0
    received: int = 0  # sequences taken in from "add" messages (added or refused)
    spec_steps: int = 0  # speculative steps (drafts checked)
    draft_tokens: int = 0  # draft tokens checked
    accepted_tokens: int = 0  # of those, kept
    step_retries: int = 0  # sequences of a failed step set apart to run again alone (StepLoop.contain)


class ThreadChannel:
    """Messages from the event loop to an engine thread: a queue and an event to sleep on."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()

    def put(self, msg) -> None:
        self._q.put(msg)
        # Event.set takes a lock and notifies: skipped while a wake-up is pending (the engine thread
        # clears the event before it drains the queue, so a message put before this check is seen)
        if not self._wake.is_set():
            self._wake.set()

    def drain(self) -> list:
        self._wake.clear()
        out = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until a message is put or `timeout` passes; True if one was."""
        return self._wake.wait(timeout)


class EngineLoop:
    """Messages: ("add", [Sequence]), ("abort", seq_id, reason), ("adapter", uid, path, name) (a LoRA
    adapter registered, before the sequences that use it), ("unadapter", uid), ("close",). Outbox: `tokens(batch,
    admitted, state)`, `error(seq_id, kind, message)`, `state(state)`; see GenerateService._deliver for
    the batch's shape; `admitted` maps the sequences first scheduled since the last report to
    (scheduled_at (time.monotonic(), one clock for every process of the machine), the prompt tokens
    found in the prefix cache then)."""

    def __init__(self, engine, config, name: str = "model"):
        self.engine = engine
        self.name = name
        caps = engine.capabilities
        # LoRA: registered adapters are swapped into the engine's slots as their sequences are admitted
        bank = getattr(engine, "lora", None)
        self.adapters = AdapterSlots(bank.slots, engine.load_adapter) if bank is not None else None
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=caps.num_blocks, block_size=caps.block_size, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
            max_model_len=caps.max_model_len, prefix_caching=config.prefix_caching,
            policy=getattr(config, "scheduling_policy", "fcfs")),
            eos_token_ids=engine.cfg.eos_token_ids, adapters=self.adapters)
        # overlap needs a device that runs behind the host; on the CPU a step is the host's own work
        on_gpu = getattr(getattr(engine, "device", None), "type", "cpu") == "cuda"
        speculator = None
        if getattr(config, "speculative_tokens", 0) and hasattr(engine, "verify"):
            if getattr(engine, "draft", None) is not None:
                speculator = DraftModelProposer(engine.draft, config.speculative_tokens, config.speculative_max_batch)
            else:
                speculator = NgramProposer(config.speculative_tokens, config.prompt_lookup_min,
                                           config.prompt_lookup_max, config.speculative_max_batch)
        self.loop = StepLoop(self.scheduler, engine, overlap=config.overlap_steps and on_gpu,
                             depth=config.overlap_depth, steps=config.decode_steps, speculator=speculator,
                             beside=getattr(config, "prefill_beside", False))
        self.seqs: dict[int, Sequence] = {}  # added and not finished
        self._fresh: list[Sequence] = []  # added, their admission not reported yet
        self.steps = 0
        self.received = 0
        self.busy_s = 0.0  # time inside the step loop (schedule, launch, read back, resolve)
        self.closed = False
        # LoRA adapters whose registration failed here (the service checked them, then their files
        # changed): their sequences are refused
        self.bad_adapters: dict[int, str] = {}
        # adapters are read on a thread of their own (~0.1 s for a large one: the steps go on meanwhile);
        # (uid, name, adapter or the exception) come back here, taken in between steps
        self._read: queue.SimpleQueue = queue.SimpleQueue()

    def state(self) -> EngineState:
        s, b = self.scheduler, self.scheduler.blocks
        return EngineState(len(s.running), len(s.waiting) + len(s.quarantine), b.num_free, b.usage, b.queried_tokens,
                           b.hit_tokens, s.preemptions, self.steps, self.loop.overlapped, self.busy_s, self.received,
                           self.loop.spec_steps, self.loop.drafted, self.loop.accepted, s.retries)

    def handle(self, msg, out) -> None:
        kind = msg[0]
        if kind == "add":
            for seq in msg[1]:
                self.received += 1
                if seq.adapter_uid and (self.adapters is None or seq.adapter_uid not in self.adapters.known):
                    out.error(seq.seq_id, INVALID, self.bad_adapters.get(
                        seq.adapter_uid, "the LoRA adapter is not registered with the engine"))
                    continue
                try:
                    self.scheduler.add(seq)
                except ValueError as exc:
                    out.error(seq.seq_id, INVALID, str(exc))
                    continue
                self.seqs[seq.seq_id] = seq
                self._fresh.append(seq)
        elif kind == "abort":
            seq = self.seqs.pop(msg[1], None)
            if seq is not None:
                self.scheduler.abort(seq, msg[2])
                self.engine.forget(seq.seq_id)
        elif kind == "adapter":
            _, uid, path, adapter_name = msg
            if self.adapters is None:
                self.bad_adapters[uid] = f"LoRA adapter '{adapter_name}': the engine has no LoRA slots"
                return
            if uid in self.adapters.known:  # the same files (uid: their digest), registered or being read
                self.adapters.retired.discard(uid)  # (another front end's, or loaded again after an unload)
                return
            self.adapters.register(uid, PENDING)
            self.bad_adapters.pop(uid, None)
            threading.Thread(target=self._read_adapter, args=(uid, path, adapter_name), daemon=True,
                             name=f"surge-{self.name}-lora").start()
        elif kind == "unadapter":
            self.scheduler.forget_adapter(msg[1])
        elif kind == "close":
            self.closed = True

    def _read_adapter(self, uid: int, path: str, adapter_name: str) -> None:
        try:
            self._read.put((uid, adapter_name, self.engine.read_adapter(path, adapter_name)))
        except Exception as exc:  # reported by the loop, which fails the adapter's sequences
            self._read.put((uid, adapter_name, exc))

    def _take_read(self, out) -> None:
        """Adapters read since the last look: registered, or their waiting sequences failed."""
        while True:
            try:
                uid, adapter_name, got = self._read.get_nowait()
            except queue.Empty:
                return
            if self.adapters.known.get(uid) is not PENDING:  # unloaded, or registered again, meanwhile
                continue
            if not isinstance(got, Exception):
                self.adapters.register(uid, got)
                continue
            log.error("LoRA adapter '%s' could not be read: %s", adapter_name, got)
            message = f"LoRA adapter '{adapter_name}' could not be loaded: {got}"
            self.bad_adapters[uid] = message
            self.adapters.drop(uid)
            for seq in [s for s in self.scheduler.waiting if s.adapter_uid == uid]:
                self.scheduler.abort(seq, "error")
                self.seqs.pop(seq.seq_id, None)
                out.error(seq.seq_id, INVALID, message)

    def _admitted(self) -> dict[int, tuple[float, int]]:
        if not self._fresh:
            return {}
        done = {s.seq_id: (s.scheduled_at, s.num_cached_prompt) for s in self._fresh if s.scheduled_at}
        # admitted ones are reported once; one aborted before it was scheduled never will be
        self._fresh = [s for s in self._fresh if not s.scheduled_at and s.status is not SeqStatus.FINISHED]
        return done

    def _contain(self, exc: Exception) -> tuple[list, list[int], str, str]:
        """A step raised: its sequences run again alone (StepLoop.contain), those found at fault fail (aborted
        here). -> (the results gathered before the exception, handed out as any step's; the failed sequences'
        ids, to report after those results; their error's kind and text)."""
        culprits = getattr(exc, "seq_ids", None)
        if culprits:  # a request's own fault (a guide its own fields contradict): one line, not a traceback a
            # client could have the log repeat at will
            log.warning("generation step: sequence(s) %s failed by their own request: %s", sorted(culprits), exc)
        else:
            log.exception("generation step failed")
        results, failed = self.loop.contain(exc)
        for seq in failed:
            self.scheduler.abort(seq, "error")
            self.seqs.pop(seq.seq_id, None)
            self.engine.forget(seq.seq_id)  # its generator, its guide's matcher
        log.warning("generation step failed: %d sequence(s) to run again alone, %d failed",
                    len(self.scheduler.quarantine), len(failed))
        # A failed request gets this text, not the exception's own words (a path, a shape, another request's
        # token): those stay in the log.
        if culprits:  # the rows' own requests at fault (the sampler's GuideRejected): a 400
            return results, [q.seq_id for q in failed], INVALID, (
                "the structured-output constraint left no token to continue the answer: the request's own "
                "allowed_token_ids, bad_words or logit_bias (or this model's vocabulary) exclude every token its "
                "format allows next, or the format goes past the parser's limits there (it forces more than "
                f"{MAX_FORCED_BYTES:,} bytes at once, or is too complex)")
        return results, [q.seq_id for q in failed], ENGINE, \
            f"generation failed ({type(exc).__name__}); the server's log has the details"

    def run(self, channel, out) -> None:
        loop = self.loop

        def refresh() -> None:
            for msg in channel.drain():
                self.handle(msg, out)

        while not self.closed:
            for msg in channel.drain():
                self.handle(msg, out)
            if self.adapters is not None:
                self._take_read(out)
            if self.closed:
                break
            if not loop.busy:
                out.state(self.state())
                channel.wait()
                continue
            try:
                t0 = time.perf_counter()
                results = loop.step(refresh, channel.wait)
                self.busy_s += time.perf_counter() - t0
            except Exception as exc:  # contained: only the sequences found at fault fail, the service keeps serving
                results, failed, kind, why = self._contain(exc)
            else:
                failed = ()
                if loop.stalled:
                    # nothing fits now (cannot happen while something runs); wait for a change
                    channel.wait(0.05)
                    continue
            batch = []
            for r in results:
                self.steps += 1
                finished = {f.seq.seq_id: f.reason for f in r.finished} if r.finished else None
                if r.tokens:
                    batch.append((r.tokens, r.samples, finished))
                if finished:
                    for sid in finished:
                        self.seqs.pop(sid, None)
                    for sid in finished.keys() & r.tokens.keys():
                        self.engine.forget(sid)
            if batch:
                out.tokens(batch, self._admitted(), self.state())
            else:
                out.state(self.state())
            for sid in failed:
                out.error(sid, kind, why)
        if loop.busy:
            loop.involved()
        for s in list(self.scheduler.running) + list(self.scheduler.waiting) + list(self.scheduler.quarantine):
            self.scheduler.abort(s, "abort")
            out.error(s.seq_id, UNLOADED, f"model '{self.name}' was unloaded")
        self.seqs.clear()

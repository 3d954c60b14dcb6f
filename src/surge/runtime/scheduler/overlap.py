"""The iteration loop with the next decode step launched before the last one is read back.

A synchronous loop leaves the device idle while the host reads the sampled
tokens, updates the sequences, hands the tokens to the streams and schedules
the next step; at batch 64 of a 0.5B model that host work is as long as the
device step itself. Here, while every running sequence decodes greedily with
nothing waiting, step k+1 is scheduled and launched right after step k: its
input tokens are step k's outputs, gathered on the device (the engine maps each
sequence to its row of step k), so only positions, slots and block tables come
from the host, and those are known without the tokens. Then step k is read
back (one small device-to-host copy) and resolved while step k+1 runs.

`depth` steps may be in flight before the oldest is read back (1: step k+1 runs while step k is
read; 2, the default: k+1 and k+2 are queued on the device while the host reads k, so a slow host
iteration, e.g. the event loop holding the GIL while it hands a step's tokens to 64 streams, does
not leave the device idle). A launched step's input token is the previous launch's output, gathered
on the device, so the host needs no token of a step in flight.

The cost: a sequence that stops at step k (EOS, a stop token) has already been
launched in steps k+1 .. k+depth; those tokens are dropped. Sequences whose last token is
launched (max_tokens, max_model_len) are not scheduled again ("draining").
Anything else (a prompt to prefill, sampling or penalties that need the host,
a block that would need a preemption) first reads the running step back and
then takes the synchronous path, so results never differ from it.

Engine contract (engines/decoder/runner.py): can_launch(scheduled),
launch(scheduled, prev) -> handle, collect(handle) -> {seq_id: SampleOut},
step(scheduled) -> {seq_id: SampleOut}; optionally collect_tokens(handle) ->
[token] in the order of the scheduled list the handle was launched with (no
object per token).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from surge.runtime.scheduler.scheduler import Finished, ScheduledSeq, Scheduler
from surge.runtime.scheduler.sequence import SeqStatus


@dataclass
class StepResult:
    scheduled: list[ScheduledSeq]
    tokens: dict  # seq_id -> token (only the sequences that sampled and are still live)
    finished: list[Finished]
    samples: dict | None = None  # seq_id -> SampleOut where the engine sampled on the host (logprobs)


MAX_DEPTH = 3  # the engine keeps RING = MAX_DEPTH + 1 staging and read-back sets (engines/decoder/graphs.py)


class StepLoop:
    def __init__(self, scheduler: Scheduler, engine, overlap: bool = True, depth: int = 2):
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"depth must be 1 to {MAX_DEPTH}, not {depth}")
        self.scheduler = scheduler
        self.engine = engine
        self.overlap = overlap
        self.depth = depth
        self._inflight: deque[tuple[list[ScheduledSeq], object]] = deque()  # oldest first
        self._current: list[ScheduledSeq] = []
        self.steps = 0
        self.overlapped = 0  # steps launched while the previous one ran
        self.stalled = False  # the last step() found work but scheduled none (nothing fits)

    @property
    def busy(self) -> bool:
        return bool(self._inflight) or self.scheduler.has_work

    def involved(self) -> list:
        """Sequences of the steps being run (to fail them when the engine raises); clears the state."""
        seqs = [s.seq for s in self._current]
        for scheduled, _ in self._inflight:
            seqs += [s.seq for s in scheduled]
        self._inflight.clear()
        self._current = []
        return list({id(q): q for q in seqs}.values())

    def _complete_all(self, results: list[StepResult]) -> None:
        while self._inflight:
            results.append(self._complete())

    def _complete(self) -> StepResult:
        """Read back the oldest launched step."""
        scheduled, handle = self._inflight.popleft()
        collect_tokens = getattr(self.engine, "collect_tokens", None)
        if collect_tokens is not None:
            # in the order of the scheduled list the step was launched with; a sequence that ended
            # before this read-back (aborted, or stopped at the step before) has a token here that
            # nobody asked for: resolve_rows() skips it
            tokens, finished = self.scheduler.resolve_rows(scheduled, collect_tokens(handle))
            return StepResult(scheduled, tokens, finished)
        got = {k: o.token for k, o in self.engine.collect(handle).items()}
        running = SeqStatus.RUNNING
        tokens = {s.seq.seq_id: got[s.seq.seq_id] for s in scheduled if s.sample and s.seq.status is running}
        finished = self.scheduler.resolve(scheduled, tokens)
        return StepResult(scheduled, tokens, finished)

    def step(self) -> list[StepResult]:
        """One iteration: the results that became known (none, one or two steps')."""
        sched, engine = self.scheduler, self.engine
        results: list[StepResult] = []
        self.stalled = False
        if self._inflight and not sched.decode_fits():
            self._complete_all(results)
        if not sched.has_work:
            self._complete_all(results)
            return results
        scheduled = sched.schedule()
        self._current = scheduled
        if self._inflight:
            if scheduled and engine.can_launch(scheduled):
                handle = engine.launch(scheduled, self._inflight[-1][1])
                sched.advance(scheduled)
                self.overlapped += 1
                self.steps += 1
                self._inflight.append((scheduled, handle))
                self._current = []
                while len(self._inflight) > self.depth:
                    results.append(self._complete())
                return results
            self._complete_all(results)
            scheduled = [s for s in scheduled if s.seq.status is SeqStatus.RUNNING]
        if not scheduled:
            self._current = []
            self.stalled = not results
            return results
        self.steps += 1
        if self.overlap and engine.can_launch(scheduled):
            handle = engine.launch(scheduled, None)
            sched.advance(scheduled)
            self._inflight.append((scheduled, handle))
            self._current = []
            return results
        outs = engine.step(scheduled)
        tokens = {k: o.token for k, o in outs.items()}
        finished = sched.update(scheduled, tokens)
        self._current = []
        results.append(StepResult(scheduled, tokens, finished, outs))
        return results

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

`steps` > 1 (multi-step launches, as vLLM's multi-step scheduling): one launch runs up to that many
decode steps back to back on the device, each step's inputs (token, position, cache slot) made on the
device from the one before, so the host schedules, stages, reads back and hands tokens to the streams
once a launch instead of once a token; a host slower than the device step (a busy machine, the GIL
shared with the event loop) then paces launches, not tokens. The blocks of all of a launch's tokens are
taken at launch (no preemption inside one), and a launch never passes a sequence's max_tokens; tokens
reach the streams a launch at a time (a burst of up to `steps`).

With a `speculator` (speculative decoding, runtime/scheduler/ngram.py) a step of at most its
`max_batch` decodes (greedy or sampled, without penalties, guides or logprobs) looks draft tokens up in the sequences' own tokens, so whatever is in flight is
read back first; if any sequence has drafts the step checks them (engine.verify) and is resolved at
once, a result for each new-token index; otherwise it is launched as above. Larger steps are not
speculated and keep launching ahead.

The cost: a sequence that stops at step k (EOS, a stop token) has already been
launched in steps k+1 .. k+depth; those tokens are dropped. Sequences whose last token is
launched (max_tokens, max_model_len) are not scheduled again ("draining").
Anything else (a prompt to prefill, sampling or penalties that need the host,
a block that would need a preemption) first reads the running step back and
then takes the synchronous path, so results never differ from it.

`beside` (the engine's prefill_beside): prompts that arrive while decode launches are in flight, and
that the engine can prefill beside them (on a GPU: the row graphs replayed on a second CUDA stream),
are prefilled and sampled at once, without waiting for those launches (up to depth x steps decode
steps: most of a joining request's time to first token otherwise); the running sequences' decodes
are launched as before, and the new sequences join the launch after. Any step that samples some
sequence's first token tries this first (a prompt cached but for its last token is a one-token
chunk, which would otherwise be launched behind them as a decode). A prompt step runs beside only
when none of its blocks was freed or named from launched tokens since the oldest launch in flight
was made (BlockManager.settled: the device may still be writing those), and each of its sequences
ends its prompt in it; otherwise the synchronous path above.

Engine contract (engines/decoder/runner.py): can_launch(scheduled),
launch(scheduled, prev) -> handle, collect(handle) -> {seq_id: SampleOut},
step(scheduled) -> {seq_id: SampleOut}; optionally collect_tokens(handle) ->
[token] in the order of the scheduled list the handle was launched with (no
object per token). Multi-step launches also need launch_steps(scheduled) -> the
most decode steps one launch of them can run, launch(scheduled, prev, steps), and
collect_tokens(handle) -> steps x len(scheduled) tokens, step-major. `beside` also needs
can_prefill_beside(scheduled) and prefill_beside(scheduled) -> {seq_id: SampleOut} (which must not wait
for the launches in flight).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from surge.runtime.scheduler.scheduler import BROKEN_AFTER, MAX_RETRIES, Scheduler
from surge.runtime.scheduler.sequence import SeqStatus
from surge.runtime.scheduler.step import Finished, ScheduledSeq


@dataclass
class StepResult:
    scheduled: list[ScheduledSeq]
    tokens: dict  # seq_id -> token (only the sequences that sampled and are still live)
    finished: list[Finished]
    samples: dict | None = None  # seq_id -> SampleOut where the engine sampled on the host (logprobs)


MAX_DEPTH = 3  # the engine keeps RING = MAX_DEPTH + 1 staging and read-back sets (engines/decoder/graphs.py)
POLL_S = 2e-4  # how often a wait for the device that an arrival can cut short looks at the device


class StepLoop:
    def __init__(self, scheduler: Scheduler, engine, overlap: bool = True, depth: int = 2, steps: int = 1,
                 speculator=None, beside: bool = False):
        """`speculator` (runtime/scheduler/ngram.NgramProposer or draft_model.DraftModelProposer, needs
        engine.verify; `k`, `max_batch`, `drafts(scheduled, scheduler)` -> drafts with their KV blocks taken,
        `kept(scheduled, drafts)` after the step): decode steps check draft tokens and keep those the model
        agrees with (speculative decoding)."""
        if not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"depth must be 1 to {MAX_DEPTH}, not {depth}")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, not {steps}")
        self.scheduler = scheduler
        self.engine = engine
        self.overlap = overlap
        self.depth = depth
        # decode steps a launch may run; an engine that cannot run several runs one
        multi = hasattr(engine, "launch_steps") and hasattr(engine, "collect_tokens")
        self.max_steps = steps if multi else 1
        # oldest first: (scheduled, handle, decode steps the handle runs, the blocks' clock at launch)
        self._inflight: deque[tuple[list[ScheduledSeq], object, int, int]] = deque()
        self._current: list[ScheduledSeq] = []
        # the quarantine's head while its step alone is being made or run: if that raises, it is the one at fault
        # (not whatever is first in the quarantine when a later step, or a read-back, raises)
        self._alone = None
        self._results: list[StepResult] = []  # the results of the step being run, so far
        # the clock of the oldest launch that involved() dropped from _inflight: the device may still run it
        # (and write blocks freed since) until a later launch is read back
        self._dropped: int | None = None
        self.steps = 0
        self.overlapped = 0  # steps launched while the previous one ran
        self.stalled = False  # the last step() found work but scheduled none (nothing fits)
        self.speculator = speculator
        self.drafted = 0  # draft tokens checked by speculative steps
        self.accepted = 0  # of those, kept
        self.spec_steps = 0
        self.beside = beside and hasattr(engine, "prefill_beside")
        self.beside_steps = 0  # prompt steps run beside the launches in flight

    @property
    def busy(self) -> bool:
        return bool(self._inflight) or self.scheduler.has_work

    def involved(self) -> list:
        """Sequences of the steps being run, and of the results gathered before the engine raised (to fail them
        all: the loop's end); clears the state."""
        seqs, results = self._drop_books()
        for r in results:
            seqs += [s.seq for s in r.scheduled]
        return list({id(q): q for q in seqs}.values())

    def _drop_books(self) -> tuple[list, list[StepResult]]:
        """-> (the sequences of the step being run and of the launches in flight, the results gathered before the
        engine raised); the loop's books cleared."""
        seqs = [s.seq for s in self._current]
        self._alone = None
        for scheduled, *_ in self._inflight:
            seqs += [s.seq for s in scheduled]
        results = self._results
        if self._inflight:
            oldest = self._inflight[0][3]
            self._dropped = oldest if self._dropped is None else min(self._dropped, oldest)
        self._inflight.clear()
        self._current = []
        self._results = []
        return seqs, results

    def contain(self, exc: BaseException | None = None) -> tuple[list[StepResult], list]:
        """After step() raised (an engine call: a bad row, a guide's matcher or logits processor, an asynchronous
        device error): -> (the results gathered before the exception, to hand out as any step's: launches read
        back, a step run; the sequences that fail, to abort). The step's other live sequences are set apart
        (Scheduler.isolate: their unread launched tokens cut, their blocks freed, recomputed later) to run a step
        alone each, and the engine's per-sequence state (a seeded generator, a guide's matcher) is put back where
        their tokens leave it (engine.rewind). A sequence fails when its step alone raised, or when it was set
        apart MAX_RETRIES times already; after BROKEN_AFTER steps alone raised in a row the engine is taken as
        broken and every sequence of the quarantine fails. A batch's step beside the quarantine (step()) is
        contained as any: its sequences join the quarantine's tail. Launches dropped here still run on the device:
        the block clock of the oldest counts until a later launch is read back (_prefill_beside), and steps alone
        run synchronously, behind them. Where `exc` names the rows at fault (its `seq_ids`: the sampler's
        GuideRejected, a request's own constraint), those fail at once and no other is blamed: each goes back to
        the waiting queue's front as a preempted sequence (no step alone, no retry counted against it), and no
        step alone counts as the engine's failure."""
        sched = self.scheduler
        alone = self._alone  # (None: the step that raised was not a step alone)
        seqs, results = self._drop_books()
        live = list({id(q): q for q in seqs if q.status is not SeqStatus.FINISHED}.values())
        rewind = getattr(self.engine, "rewind", None)
        culprits = getattr(exc, "seq_ids", None)
        if culprits:  # a request's fault: once its neighbours lost retries to it, and 3 in a row failed every one
            failed = [q for q in live if q.seq_id in culprits]
            for q in live:
                if q.seq_id not in culprits:
                    sched.isolate(q, blamed=False)
                    if rewind is not None:
                        rewind(q)
            return results, failed
        failed = []
        if alone is not None and alone.status is not SeqStatus.FINISHED:  # its step alone raised
            sched.solo_failures += 1
            failed.append(alone)
            if sched.solo_failures >= BROKEN_AFTER:
                failed += [q for q in sched.quarantine if q is not alone]
        for q in live:
            if q in failed:
                continue
            if q.retries >= MAX_RETRIES:
                failed.append(q)
                continue
            sched.isolate(q)
            if rewind is not None:
                rewind(q)
        return results, failed

    def _complete_all(self, results: list[StepResult]) -> None:
        while self._inflight:
            self._complete(results)

    def _complete(self, results: list[StepResult]) -> None:
        """Read back the oldest launched step (a result for each of its decode steps)."""
        # taken off the launches in flight once read: a read-back that raises (a device error) leaves its
        # sequences to involved()
        scheduled, handle, steps, _ = self._inflight[0]
        collect_tokens = getattr(self.engine, "collect_tokens", None)
        if collect_tokens is not None:
            # in the order of the scheduled list the step was launched with; a sequence that ended
            # before this read-back (aborted, or stopped at the step before) has a token here that
            # nobody asked for: resolve_rows() skips it
            got = collect_tokens(handle)
            self._inflight.popleft()
            self._dropped = None  # (the launches before this one have run too)
            b = len(scheduled)
            for j in range(steps):
                tokens, finished = self.scheduler.resolve_rows(scheduled, got[j * b:(j + 1) * b], j)
                results.append(StepResult(scheduled, tokens, finished))
            return
        got = {k: o.token for k, o in self.engine.collect(handle).items()}
        self._inflight.popleft()
        self._dropped = None
        running = SeqStatus.RUNNING
        tokens = {s.seq.seq_id: got[s.seq.seq_id] for s in scheduled if s.sample and s.seq.status is running}
        finished = self.scheduler.resolve(scheduled, tokens)
        results.append(StepResult(scheduled, tokens, finished))

    def _launch(self, scheduled: list[ScheduledSeq], prev) -> None:
        """Launch `scheduled` (after `prev`'s handle, or none), as many decode steps as allowed."""
        sched, engine, steps = self.scheduler, self.engine, 1
        if self.max_steps > 1:
            steps = sched.launch_steps(scheduled, min(self.max_steps, engine.launch_steps(scheduled)))
            if steps > 1 and sched.decode_fits(steps):
                sched.reserve(scheduled, steps)
            else:
                steps = 1
        handle = engine.launch(scheduled, prev, steps) if steps > 1 else engine.launch(scheduled, prev)
        sched.advance(scheduled, steps)
        self._inflight.append((scheduled, handle, steps, sched.blocks.clock))
        self.steps += steps

    @staticmethod
    def _speculable(scheduled: list[ScheduledSeq]) -> bool:
        """A step of decodes whose drafts can be checked: greedy or sampled, without penalties, guides or
        logprobs (those sample on the host, a token a step)."""
        return all(s.num_tokens == 1 and s.sample and s.seq.speculable for s in scheduled)

    def _speculate(self, scheduled: list[ScheduledSeq], results: list[StepResult]) -> bool:
        """A speculative step if any sequence has drafts (False: none has, nothing was done)."""
        sched, spec = self.scheduler, self.speculator
        drafts = spec.drafts(scheduled, sched)
        if not any(drafts):
            return False
        greedy = self.engine.verify(scheduled, drafts)
        self.steps += 1
        self.spec_steps += 1
        self.drafted += sum(map(len, drafts))
        for j, (tokens, finished) in enumerate(sched.accept(scheduled, drafts, greedy)):
            if j:
                self.accepted += len(tokens)
            results.append(StepResult(scheduled, tokens, finished))
        spec.kept(scheduled, drafts)
        return True

    def _prefill_beside(self, scheduled: list[ScheduledSeq], results: list[StepResult]) -> bool:
        """Prefill this step's new prompts beside the launches in flight and return their first tokens at once
        (False: the step does not qualify, nothing was done)."""
        sched, engine = self.scheduler, self.engine
        flying = {id(s.seq) for sch, *_ in self._inflight for s in sch}
        prompts = [s for s in scheduled if id(s.seq) not in flying]
        decodes = [s for s in scheduled if id(s.seq) in flying]
        if not prompts or (decodes and not engine.can_launch(decodes)) or not engine.can_prefill_beside(prompts):
            return False
        since = self._inflight[0][3] if self._dropped is None else min(self._dropped, self._inflight[0][3])
        if not sched.blocks.settled((b for s in prompts for b in s.seq.block_table), since):
            return False
        outs = engine.prefill_beside(prompts)
        self.steps += 1
        self.beside_steps += 1
        tokens = {k: o.token for k, o in outs.items()}
        results.append(StepResult(prompts, tokens, sched.update(prompts, tokens), outs))
        # the first tokens go out now: no wait for the device here. The running sequences' decodes are launched
        # if that needs no read-back first (else the next iteration launches them, the new sequences with them,
        # their input token from the host)
        if decodes and len(self._inflight) <= self.depth:
            self._launch_more(decodes, results)
        self._current = []
        return True

    def _launch_more(self, scheduled: list[ScheduledSeq], results: list[StepResult]) -> None:
        """Launch behind the launches in flight: at most depth + 1 of them (one more than depth while a wait for
        the oldest was cut short by an arrival)."""
        if len(self._inflight) > self.depth:
            self._complete(results)
            # a sequence that stopped in the launch just read back has lost the later tokens it was scheduled on
            scheduled = [s for s in scheduled if s.seq.status is SeqStatus.RUNNING]
            if not scheduled:
                return
        self._launch(scheduled, self._inflight[-1][1])
        self.overlapped += 1

    def _settle(self, results: list[StepResult], wait) -> None:
        """Read back the oldest launches until at most depth are in flight; with `wait(timeout) -> bool` (True:
        something arrived for the loop) and an engine that says when a launch is done (ready(handle)), a wait
        for the device ends early when something arrives, so a new prompt is seen (and prefilled beside the
        launches) at once instead of after the oldest launch."""
        ready = getattr(self.engine, "ready", None) if self.beside else None
        while len(self._inflight) > self.depth:
            if wait is not None and ready is not None:
                handle = self._inflight[0][1]
                while not ready(handle):
                    if wait(POLL_S):
                        return
            self._complete(results)

    def step(self, refresh=None, wait=None) -> list[StepResult]:
        """One iteration: the results that became known (none, one or two steps'). `refresh()` is
        called after the loop has waited for its launches in flight, to add (or abort) what arrived
        meanwhile: new sequences then join the step that follows instead of one more of their own.
        `wait(timeout) -> bool` (with `beside`): waits up to timeout seconds for something to arrive
        (True if it did); the iteration then returns without waiting for the device (_settle).
        While the scheduler's quarantine holds a sequence (contain()), an iteration first reads back what is in
        flight and runs the quarantine's head's step alone, synchronously; then the batch's step of everyone else
        (admissions included), launched or run as in any iteration: a healthy sequence advances every iteration
        but one whose step alone raises (which raises out of step(), for contain()), and the quarantine drains by
        a step alone every iteration, however busy the batch."""
        sched, engine = self.scheduler, self.engine
        results: list[StepResult] = []
        self._results = results
        self.stalled = False
        if sched.quarantine:
            # after a failed step (contain()): its first sequence's step alone, synchronously, behind what is in
            # flight (read back first: a launch that raises then is contained as the batch's, not blamed on the
            # sequence alone); then the batch's step as in any iteration, so that the other sequences keep their
            # pace and the waiting are admitted while the quarantine drains
            self._complete_all(results)
            self._alone = sched.quarantine[0]
            scheduled = sched.solo()
            self._current = scheduled
            self._run_sync(scheduled, results)
            self._alone = None
        if self._inflight and not sched.decode_fits():
            self._complete_all(results)
            if refresh is not None:
                refresh()
        if not sched.has_work:
            self._complete_all(results)
            return results
        scheduled = sched.schedule()
        self._current = scheduled
        spec = self.speculator
        if spec is not None and 0 < len(scheduled) <= spec.max_batch and self._speculable(scheduled):
            if self._inflight:  # drafts are looked up in the sequences' tokens: read what is in flight
                self._complete_all(results)
                if refresh is not None:
                    refresh()
                scheduled = sched.admit([s for s in scheduled if s.seq.status is SeqStatus.RUNNING])
                self._current = scheduled
            if 0 < len(scheduled) <= spec.max_batch and self._speculable(scheduled) \
                    and self._speculate(scheduled, results):
                self._current = []
                return results
        if self._inflight:
            # a step with a sequence's first token to sample (a prompt's chunk; a prompt cached but for its last
            # token, which looks like a decode) goes beside the launches if it can, not behind them
            if scheduled and self.beside and any(not s.seq.output_ids for s in scheduled) \
                    and self._prefill_beside(scheduled, results):
                return results
            if scheduled and engine.can_launch(scheduled):
                self._launch_more(scheduled, results)
                self._current = []
                self._settle(results, wait)
                return results
            self._complete_all(results)
            if refresh is not None:  # arrivals while draining (up to depth x steps decode steps) join
                refresh()
            scheduled = sched.admit([s for s in scheduled if s.seq.status is SeqStatus.RUNNING])
        if not scheduled:
            self._current = []
            self.stalled = not results
            return results
        if self.overlap and engine.can_launch(scheduled):
            self._launch(scheduled, None)
            self._current = []
            return results
        return self._run_sync(scheduled, results)

    def _run_sync(self, scheduled: list[ScheduledSeq], results: list[StepResult]) -> list[StepResult]:
        self.steps += 1
        outs = self.engine.step(scheduled)
        tokens = {k: o.token for k, o in outs.items()}
        finished = self.scheduler.update(scheduled, tokens)
        self._current = []
        results.append(StepResult(scheduled, tokens, finished, outs))
        return results

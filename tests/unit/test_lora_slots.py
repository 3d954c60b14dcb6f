"""LoRA adapters swapped through an engine's slots at admission (runtime/scheduler/adapters.py), with the
scheduler: which sequences are admitted, which slot each reads, what is written into a slot and when."""

from __future__ import annotations

from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence, SeqStatus
from surge.runtime.scheduler.adapters import AdapterSlots


def _setup(slots=2, num_blocks=64, max_num_seqs=8):
    loads = []
    pool = AdapterSlots(slots, lambda slot, adapter: loads.append((slot, adapter)))
    for uid in (11, 22, 33):
        pool.register(uid, f"weights-{uid}")
    sched = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=256, max_model_len=64), adapters=pool)
    return pool, sched, loads


def _seq(i, uid, n=6, max_tokens=3):
    s = Sequence(i, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    s.adapter_uid = uid
    return s


def _step(sched):
    scheduled = sched.schedule()
    sched.update(scheduled, {s.seq.seq_id: 7 for s in scheduled if s.sample})
    return scheduled


def test_a_third_adapter_waits_for_a_slot_and_others_pass_it():
    pool, sched, loads = _setup()
    seqs = [_seq(0, 11), _seq(1, 22), _seq(2, 33), _seq(3, 0), _seq(4, 11, max_tokens=8)]
    for s in seqs:
        sched.add(s)
    first = {s.seq.seq_id for s in _step(sched)}
    assert first == {0, 1, 3, 4}  # 33 has no slot: passed over, the base model's and 11's behind it go
    assert seqs[2].status is SeqStatus.WAITING and seqs[2].adapter == 0
    assert sorted(loads) == [(1, "weights-11"), (2, "weights-22")]
    assert seqs[0].adapter == seqs[4].adapter and seqs[3].adapter == 0 and pool.users[seqs[0].adapter] == 2
    while seqs[1].status is not SeqStatus.FINISHED:  # 22's only sequence ends: its slot is free to reuse
        _step(sched)
    assert pool.users[2] == 0 and pool.held[2] == 22  # free to reuse, still holding 22
    _step(sched)
    assert seqs[2].status is not SeqStatus.WAITING and seqs[2].adapter == 2  # 22's slot, not 11's (in use)
    assert loads[-1] == (2, "weights-33") and pool.loads == 3 and 22 not in pool.slot_of
    while sched.has_work:
        _step(sched)
    assert pool.users == [0, 0, 0] and all(s.adapter == 0 for s in seqs)


def test_a_held_adapter_is_not_loaded_again_and_lru_picks_the_victim():
    pool, sched, loads = _setup()
    for i, uid in enumerate((11, 22)):
        sched.add(_seq(i, uid, max_tokens=1))
    while sched.has_work:
        _step(sched)
    sched.add(_seq(2, 11, max_tokens=1))  # 11 still in its slot: no load; now 22 is the least recent
    _step(sched)
    assert len(loads) == 2
    sched.add(_seq(3, 33, max_tokens=1))
    _step(sched)
    assert loads[-1] == (pool.slot_of[33], "weights-33") and 22 not in pool.slot_of and 11 in pool.slot_of


def test_preemption_and_abort_release_the_slot():
    pool, sched, loads = _setup(slots=1, num_blocks=5, max_num_seqs=4)
    a, b = _seq(0, 11, n=7, max_tokens=20), _seq(1, 11, n=7, max_tokens=20)
    sched.add(a)
    sched.add(b)
    _step(sched)
    assert pool.users[1] == 2
    while sched.preemptions == 0:
        _step(sched)
    preempted = b if b.status is SeqStatus.WAITING else a
    assert preempted.adapter == 0 and pool.users[1] == 1
    sched.abort(a if preempted is b else b)
    assert pool.users[1] == 0
    sched.abort(preempted)  # waiting: nothing held
    assert pool.users[1] == 0 and not sched.has_work


def test_registered_again_or_forgotten():
    pool, sched, loads = _setup(slots=1)
    sched.add(_seq(0, 11, max_tokens=1))
    _step(sched)
    pool.register(11, "weights-11")  # another front end's registration: the same files, the slot kept
    sched.add(_seq(1, 11, max_tokens=1))
    _step(sched)
    assert loads == [(1, "weights-11")] and pool.slot_of == {11: 1}
    running = _seq(2, 11, max_tokens=5)
    sched.add(running)
    _step(sched)
    waiting = _seq(3, 11, max_tokens=2)
    sched.add(waiting)
    sched.forget_adapter(11)  # unloaded while a sequence runs and one waits: kept until both end
    assert pool.slot_of == {11: 1} and 11 in pool.known
    while sched.has_work:
        _step(sched)
    assert waiting.output_ids == [7, 7] and running.status is SeqStatus.FINISHED
    assert pool.slot_of == {} and pool.held == [None, None] and 11 not in pool.known
    sched.add(_seq(4, 22, max_tokens=1))
    sched.forget_adapter(33)  # nothing of it waits or runs: dropped at once
    assert 33 not in pool.known


def test_the_engine_loop_reads_adapters_off_its_thread_and_fails_what_waits_on_a_bad_one(tmp_path):
    """("adapter", uid, path, name): the loop registers it as pending at once (its sequences wait, others
    run), reads it on a thread and takes the result between steps; a directory that cannot be read fails
    the sequences waiting for it, with the reason."""
    import time

    import pytest

    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from surge.config import GenerationConfig
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_core import EngineLoop
    from surge.runtime.scheduler.adapters import PENDING
    from tests.decoder_models import build_lora, build_model

    base = build_model("qwen2", tmp_path / "m", seed=1)
    good = build_lora(base, tmp_path / "good", r=4)
    engine = DecoderEngine(base, num_blocks=32, block_size=4, max_loras=1, max_lora_rank=4)
    core = EngineLoop(engine, GenerationConfig(max_num_seqs=4, max_loras=1).resolved())

    class Out:
        errors: list = []

        def error(self, seq_id, kind, message):
            self.errors.append((seq_id, kind, message))

    out = Out()
    core.handle(("adapter", 5, str(good), "good"), out)
    core.handle(("adapter", 6, str(tmp_path / "gone"), "gone"), out)
    assert core.adapters.known[5] is PENDING and core.adapters.known[6] is PENDING
    waiting = [_seq(0, 5), _seq(1, 6), _seq(2, 0)]
    core.handle(("add", waiting), out)
    # until the loop takes the reads in, only the base model's sequence can be admitted
    assert [s.seq.seq_id for s in core.scheduler.schedule()] == [2]
    deadline = time.monotonic() + 30
    while PENDING in core.adapters.known.values() and time.monotonic() < deadline:
        time.sleep(0.05)
        core._take_read(out)
    assert hasattr(core.adapters.known[5], "weights") and 6 not in core.adapters.known
    assert [(e[0], e[1]) for e in out.errors] == [(1, "invalid")] and "could not be loaded" in out.errors[0][2]
    assert waiting[1].status is SeqStatus.FINISHED and waiting[0].status is SeqStatus.WAITING
    core.handle(("add", [_seq(3, 6)]), out)  # a later one of the bad adapter: refused at once
    assert out.errors[-1][0] == 3

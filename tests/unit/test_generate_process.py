"""A decoder's engine loop in its own process (GenerationConfig.engine_process) on the CPU: the same
tokens as transformers and as the loop on a thread, aborts that free the child's KV blocks, a child
that dies (started again, within limits) or fails to load, a queue limit counted across the process
boundary, a clean close, the reader of the child's messages."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from prometheus_client import CollectorRegistry  # noqa: E402

from surge.errors import ConfigError, EngineError, NotReady, Overloaded  # noqa: E402
from surge.runtime.scheduler import SamplingParams  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("m") / "q", seed=7)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _load(path, registry=None, **gen):
    from surge.runtime.generate_service import GenerationConfig
    from surge.runtime.generate_load import load_generate_service

    config = GenerationConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 160,
                                 "kv_cache_tokens": 1024, "block_size": 4, "cache_entries": 0,
                                 "engine_process": True, **gen})
    s = load_generate_service(path, "m", config=config, threads=1, request_timeout_s=60)
    if registry is not None:  # the service's metrics on a registry of the test's own
        from surge.runtime.generate_metrics import GenerateMetrics

        s.metrics = GenerateMetrics("m", "1", registry)
    s.mark_ready()
    return s


def _hf_greedy(hf, ids, n):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _prompts(service, count):
    texts = ["Define assignment.", "The augmented assignment statement", "Python", "a b c d e f g h i j k l m n",
             "What is a variable?", "Loops repeat"]
    return [service.encode(texts[i % len(texts)] * (1 + i % 3)) for i in range(count)]


def test_streams_equal_transformers_and_the_thread_loop(model_dir, hf):
    """Prompts of different lengths, joining a running batch at different times, through the child:
    every stream's tokens are transformers' greedy ones, and equal the same service's on a thread."""
    service = _load(model_dir)
    assert service.remote and service.engine.exit_code() is None and service.engine.pid != os.getpid()
    prompts = _prompts(service, 6)

    async def run(svc):
        async def one(i, p):
            await asyncio.sleep(0.02 * i)  # later ones join a batch that is decoding
            ids = []
            async for d in svc.stream(p, SamplingParams(max_tokens=10 + i, **GREEDY)):
                ids.extend(d.token_ids)
            return ids

        async def guided():  # a structured output: the guide crosses the process with its sequence
            guide = ("choice", '["assignment", "Python", "loops repeat"]')
            r = await svc.generate(prompts[0], SamplingParams(max_tokens=12, temperature=0.0, guide=guide))
            return r.text

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)), guided())

    async def both():
        remote = await run(service)
        stats = service.stats()
        await service.close()
        local = _load(model_dir, engine_process=False)
        assert not local.remote
        here = await run(local)
        await local.close()
        return remote, here, stats

    remote, here, stats = asyncio.run(both())
    assert remote[-1] in ("assignment", "Python", "loops repeat")
    for i, (p, ids) in enumerate(zip(prompts, remote)):
        assert ids == _hf_greedy(hf, p, 10 + i), i
    assert remote == here
    assert stats["engine_process"] == service.engine.pid and stats["running"] == 0 and stats["steps"] > 0
    assert service.engine.exit_code(wait=10) == 0  # closed, not killed


def test_an_aborted_stream_frees_its_blocks_in_the_child_and_leaves_its_neighbour_alone(model_dir, hf):
    reg = CollectorRegistry()
    service = _load(model_dir, reg)
    free_at_start = None
    a, b = _prompts(service, 2)

    async def main():
        nonlocal free_at_start
        await service.generate(a, SamplingParams(max_tokens=2, **GREEDY))  # a state report
        free_at_start = service.stats()["free_blocks"]
        gone = service.stream(a, SamplingParams(max_tokens=150, **GREEDY))
        stay = asyncio.ensure_future(service.generate(b, SamplingParams(max_tokens=24, **GREEDY)))
        got = 0
        async for d in gone:
            got += len(d.token_ids)
            if got >= 3:
                break
        await gone.aclose()  # the client left: an abort to the child
        kept = await stay
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (service.stats()["free_blocks"] != free_at_start
                                               or service.stats()["running"]):
            await asyncio.sleep(0.02)
        stats = service.stats()
        await service.close()
        return kept, stats

    kept, stats = asyncio.run(main())
    assert kept.token_ids == _hf_greedy(hf, b, 24)
    assert stats["running"] == 0 and stats["free_blocks"] == free_at_start and stats["kv_usage"] == 0.0
    # the child stopped the aborted sequence: its 150 tokens would take over 150 iterations, the
    # neighbour's 24 about 25 (the margin is for a server slow to send the abort)
    assert stats["steps"] < 100, stats
    labels = {"model": "m", "version": "1"}
    assert reg.get_sample_value("surge_generate_requests_total", {**labels, "finish_reason": "abort"}) == 1
    assert reg.get_sample_value("surge_generate_kv_cache_usage_ratio", labels) == 0.0
    assert reg.get_sample_value("surge_generate_output_tokens_total", labels) >= 2 + 3 + 24


def test_a_dead_engine_process_fails_its_streams_at_once_and_is_started_again(model_dir, hf):
    """SIGKILL on the child mid-stream: the stream raises EngineError now (not at its 60 s deadline), the
    model answers NotReady while a new child loads, then serves again (transformers' tokens, the
    restart counted)."""
    reg = CollectorRegistry()
    service = _load(model_dir, reg)
    p = _prompts(service, 1)[0]
    first_pid = service.engine.pid

    async def main():
        agen = service.stream(p, SamplingParams(max_tokens=150, **GREEDY))
        await agen.__anext__()
        os.kill(first_pid, signal.SIGKILL)
        # the exit's own error, not the 60 s deadline's (DeadlineExceeded): no clock needed
        with pytest.raises(EngineError, match="engine process exited"):
            async for _ in agen:
                pass
        with pytest.raises(NotReady):
            await service.generate(p, SamplingParams(max_tokens=2, **GREEDY))
        deadline = time.monotonic() + 60
        while not service.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        again = await service.generate(p, SamplingParams(max_tokens=12, **GREEDY))
        await service.close()
        return again

    again = asyncio.run(main())
    assert service.engine.pid != first_pid and again.token_ids == _hf_greedy(hf, p, 12)
    assert reg.get_sample_value("surge_generate_engine_restarts_total", {"model": "m", "version": "1"}) == 1


def test_a_child_that_keeps_dying_leaves_the_model_not_ready(model_dir, monkeypatch):
    """At most RESTART_LIMIT restarts in RESTART_WINDOW_S: the next death leaves the model down."""
    from surge.runtime import generate_restart as gs

    monkeypatch.setattr(gs, "RESTART_LIMIT", 1)
    monkeypatch.setattr(gs, "RESTART_DELAYS_S", (0.05, 0.05))
    service = _load(model_dir)
    p = _prompts(service, 1)[0]

    async def until_ready(want: bool):
        deadline = time.monotonic() + 60
        while service.ready != want and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return service.ready

    async def main():
        await service.generate(p, SamplingParams(max_tokens=2, **GREEDY))  # attaches the reader
        os.kill(service.engine.pid, signal.SIGKILL)
        assert not await until_ready(False)
        assert await until_ready(True)  # the one restart allowed
        os.kill(service.engine.pid, signal.SIGKILL)
        assert not await until_ready(False)
        while service._restarting:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        down = not service.ready
        with pytest.raises(NotReady):
            await service.generate(p, SamplingParams(max_tokens=2, **GREEDY))
        await service.close()
        return down

    assert asyncio.run(main())


def test_close_fails_the_streams_in_flight_and_ends_the_child(model_dir):
    service = _load(model_dir)
    p = _prompts(service, 1)[0]

    async def main():
        agen = service.stream(p, SamplingParams(max_tokens=150, **GREEDY))
        await agen.__anext__()
        closing = asyncio.ensure_future(service.close())
        with pytest.raises(NotReady, match="unloaded"):
            async for _ in agen:
                pass
        await closing

    asyncio.run(main())
    assert service.engine.exit_code(wait=10) == 0


def test_the_queue_limit_counts_what_the_child_has_not_taken_in(model_dir):
    """max_waiting counts the sequences of this event-loop pass and those sent that the child has not
    taken in yet (here: a child stopped by SIGSTOP, so none is); they run once it goes on."""
    service = _load(model_dir, max_waiting=2)
    p = _prompts(service, 1)[0]
    params = SamplingParams(max_tokens=4, **GREEDY)

    async def main():
        await service.generate(p, params)
        os.kill(service.engine.pid, signal.SIGSTOP)
        try:
            first = asyncio.ensure_future(service.generate(p, params))
            await asyncio.sleep(0.05)  # its pass ended: sent, not taken in
            second = asyncio.ensure_future(service.generate(p, params))
            await asyncio.sleep(0.05)
            with pytest.raises(Overloaded):
                await service.generate(p, params)
            same_pass = await asyncio.gather(*(service.generate(p, params) for _ in range(2)),
                                             return_exceptions=True)
        finally:
            os.kill(service.engine.pid, signal.SIGCONT)
        done = await asyncio.gather(first, second)
        await service.close()
        return same_pass, done

    same_pass, done = asyncio.run(main())
    assert all(isinstance(o, Overloaded) for o in same_pass)
    assert [o.completion_tokens for o in done] == [4, 4]
    # admitted after the child went on: the queue time (KServe statistics) is the child's admission,
    # reported across the process boundary
    assert done[0].timings["queue_ns"] >= 80e6 and done[0].timings["compute_input_ns"] > 0


def test_a_load_that_fails_in_the_child_is_the_loads_error(tmp_path, model_dir):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="engine process failed"):
        _load(broken)


def test_the_event_loop_reader_reassembles_messages_split_and_merged():
    """The child's messages read on the event loop (EngineProcess.attach): frames split over many reads
    (3 MiB, the reader takes at most 1 MiB a read) and many in one read arrive whole, in order, then the
    end of the connection calls on_exit once."""
    import multiprocessing as mp
    import pickle

    from surge.runtime.generate_process import EngineProcess

    ours, theirs = mp.Pipe()
    proc = EngineProcess.__new__(EngineProcess)  # the reader alone, on a socket pair: no child needed
    proc.conn, proc._loop, proc._dir = ours, None, "/nonexistent"
    rng = torch.Generator().manual_seed(5)
    msgs = [("tokens", torch.randint(0, 1 << 30, (n,), generator=rng).tolist()) for n in (3, 700_000, 1, 7)]
    msgs += [("state", i) for i in range(200)]
    got, ended = [], []

    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        proc.attach(loop, got.append, lambda: (ended.append(1), done.set_result(None)))

        def write():
            for m in msgs:
                theirs.send_bytes(pickle.dumps(m, pickle.HIGHEST_PROTOCOL))
            theirs.close()

        await asyncio.gather(asyncio.to_thread(write), done)

    asyncio.run(main())
    assert got == msgs and ended == [1]
    assert len(pickle.dumps(msgs[1])) > 3 << 20


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_messages_larger_than_the_socket_buffer_arrive_whole_and_in_order(loop_kind):
    """What the server sends the child on the event loop (EngineProcess.send): a message of several MiB (a
    request's long stop strings or grammar) does not fit the socket's buffer. uvloop makes the socket
    non-blocking, where send_bytes stopped mid-message, told the caller the child was gone and left the
    child a cut stream (session 46: one such request killed the engine process and every stream in it).
    Every message arrives whole and in order, the small ones sent after a large one too, while the
    other side reads slowly."""
    import multiprocessing as mp
    import threading

    from surge.runtime.generate_process import EngineProcess, _loads

    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        new_loop = uvloop.new_event_loop
    else:
        new_loop = asyncio.new_event_loop
    ours, theirs = mp.Pipe()
    proc = EngineProcess.__new__(EngineProcess)  # the writer alone, on a socket pair: no child needed
    proc.conn, proc._loop, proc._dir = ours, None, "/nonexistent"
    msgs = [("add", "x" * 3_000_000), ("abort", 1, "gone"), ("add", "y" * 5_000_000)]
    msgs += [("abort", i, "r") for i in range(100)]
    got = []

    async def main():
        loop = asyncio.get_running_loop()
        proc.attach(loop, lambda m: None, lambda: None)

        def read():
            for _ in msgs:
                time.sleep(0.001)
                got.append(_loads(theirs.recv_bytes()))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert [proc.send(m) for m in msgs] == [True] * len(msgs)  # never "gone"
        while reader.is_alive():  # the loop runs meanwhile: it writes what waits as the socket drains
            await asyncio.sleep(0.01)

    loop = new_loop()
    try:
        loop.run_until_complete(main())
    finally:
        proc._detach_and_close()
        loop.close()
    assert got == msgs


def test_close_while_a_new_child_starts_leaves_no_engine_process(model_dir, monkeypatch):
    """Unloading a model whose engine process is being started again: close waits for the start and
    ends the new child too."""
    import psutil

    from surge.runtime import generate_restart as gs

    monkeypatch.setattr(gs, "RESTART_DELAYS_S", (0.0,))
    service = _load(model_dir)
    p = _prompts(service, 1)[0]

    def engines():
        return [c for c in psutil.Process().children(recursive=True)
                if c.is_running() and c.status() != psutil.STATUS_ZOMBIE
                and "surge.runtime.generate_process" in " ".join(c.cmdline())]

    async def main():
        await service.generate(p, SamplingParams(max_tokens=2, **GREEDY))
        os.kill(service.engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not service._restarting and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert service._restarting
        await asyncio.sleep(0.3)  # the new child is loading
        await service.close()
        return engines()  # at once: nothing else of this loop may run first

    assert asyncio.run(main()) == [] and not service.ready


class _Recorder:
    """EngineLoop's `out`: what it reports (each report's admissions, the finished sequence ids, the errors);
    `finished` is set once sequence `until` has finished."""

    def __init__(self, until: int):
        import threading

        self.until, self.reports, self.ended, self.errors = until, [], [], []
        self.finished = threading.Event()

    def tokens(self, batch, admitted, state):
        self.reports.append(dict(admitted))
        for _, _, f in batch:
            self.ended.extend(f or ())
        if self.until in self.ended:
            self.finished.set()

    def error(self, seq_id, kind, message):
        self.errors.append((seq_id, kind))

    def state(self, state):
        pass


def test_the_engine_loop_reports_each_admission_once_and_forgets_what_was_aborted_waiting(model_dir):
    """EngineLoop (the same on a thread and in the child): a sequence's first scheduling is reported
    once; one aborted while it waited for a slot is never reported and not kept."""
    import threading

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_core import EngineLoop, ThreadChannel
    from surge.runtime.generate_service import GenerationConfig
    from surge.runtime.scheduler import Sequence

    engine = DecoderEngine(model_dir, num_blocks=64, block_size=4, max_num_seqs=1, max_model_len=64)
    core = EngineLoop(engine, GenerationConfig(max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64))
    out = _Recorder(until=1)
    channel = ThreadChannel()
    runner = threading.Thread(target=core.run, args=(channel, out))
    a, b = (Sequence(i, [5, 6, 7, 8], SamplingParams(max_tokens=12, **GREEDY)) for i in (1, 2))
    channel.put(("add", [a, b]))  # one slot: b waits for a
    channel.put(("abort", 2, "abort"))
    runner.start()
    assert out.finished.wait(60)
    channel.put(("close",))
    runner.join(30)
    admitted = [sid for r in out.reports for sid in r]
    assert admitted == [1] and core._fresh == [] and core.seqs == {} and out.errors == []
    assert core.state().received == 2 and core.scheduler.blocks.usage == 0.0


def test_a_step_that_raises_once_fails_no_request_and_changes_no_answer(model_dir):
    """EngineLoop: an exception in a step (raised once: a transient device error) fails none of its requests (it
    failed them all before session 44): they run again alone, then batched, and get the tokens of a run without the
    error (seeded sampling: no draw of the failed step counts); nothing is kept after (sequences, blocks, seeded
    generators) and the loop goes on serving."""
    import threading

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_core import EngineLoop, ThreadChannel
    from surge.runtime.generate_service import GenerationConfig
    from surge.runtime.scheduler import Sequence

    def serve(fail_at):
        engine = DecoderEngine(model_dir, num_blocks=64, block_size=4, max_num_seqs=2, max_model_len=64)
        core = EngineLoop(engine, GenerationConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64))
        step, calls, tokens = engine.step, [], {1: [], 2: []}

        def flaky(scheduled):
            calls.append(len(calls))
            out = step(scheduled)  # the step ran (its seeded draws made), then the error surfaced
            if len(calls) == fail_at:
                raise RuntimeError("a device error")
            return out

        engine.step = flaky
        out = _Recorder(until=2)
        out.tokens = lambda batch, admitted, state, _t=out.tokens: (
            [tokens[sid].append(t) for toks, _, _ in batch for sid, t in toks.items() if sid in tokens],
            _t(batch, admitted, state))
        channel = ThreadChannel()
        runner = threading.Thread(target=core.run, args=(channel, out), daemon=True)
        seeded = [Sequence(i, [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.8, seed=i)) for i in (1, 2)]
        channel.put(("add", seeded))
        runner.start()
        for _ in range(600):
            if {1, 2} <= set(out.ended) or out.errors:
                break
            threading.Event().wait(0.05)
        assert not out.errors and {1, 2} <= set(out.ended)
        assert engine.sampler._generators == {}, "the finished requests' generators were kept"
        out.until, out.finished = 3, threading.Event()
        channel.put(("add", [Sequence(3, [5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))]))
        assert out.finished.wait(60), "the loop goes on serving"
        channel.put(("close",))
        runner.join(30)
        assert core.seqs == {} and core.scheduler.blocks.usage == 0.0
        return tokens, core.scheduler.retries

    ref, none = serve(0)
    got, retried = serve(3)
    assert none == 0 and retried == 2
    assert got == ref and all(len(t) == 12 for t in got.values())


def test_the_engine_loop_runs_in_a_process_of_its_own_by_default(model_dir):
    """GenerationConfig.engine_process unset: a process of its own on the CPU too (the engine's OpenMP team is then
    its process's only one: on a thread beside the main thread's, libgomp stops spinning between regions)."""
    from surge.runtime.generate_service import GenerationConfig
    from surge.runtime.generate_load import load_generate_service

    config = GenerationConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, kv_cache_tokens=512,
                              block_size=4, cache_entries=0)
    assert config.engine_process is None
    service = load_generate_service(model_dir, "m", config=config, threads=1, request_timeout_s=60)
    try:
        assert service.remote and service.engine.pid != os.getpid()
    finally:
        asyncio.run(service.close())

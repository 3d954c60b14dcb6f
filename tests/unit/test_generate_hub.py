"""A decoder's engine loop shared by several front ends (runtime/generate_hub.py), on the CPU: a real
engine process (`python -m surge.cli.workers engine ...`, as the supervisor of `--workers` starts it)
and two GenerateServices in this process, each with its own HubClient, as two front ends would be.

- both front ends' streams equal transformers' greedy tokens, though both number their sequences
  from 1 (the hub's own ids keep them apart);
- a front end that leaves mid-stream has its sequences aborted (the engine's running count and free
  KV blocks come back), its neighbour's streams unchanged;
- SIGTERM on the engine process fails every stream in flight at once as unloaded; each front end
  connects to the engine process started again and serves transformers' tokens.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from surge.errors import NotReady  # noqa: E402
from surge.runtime.scheduler import SamplingParams  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402

GREEDY = dict(temperature=0.0, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("hub") / "q", seed=9)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture
def hub(model_dir, tmp_path, monkeypatch):
    """(start(), socket path, config): the engine process of a decoder under --workers."""
    from surge.cli.workers import child_config
    from surge.config import ServerConfig
    from surge.runtime.generate_hub import AUTHKEY_ENV

    monkeypatch.setenv(AUTHKEY_ENV, secrets.token_hex(32))
    config = ServerConfig(model_dir=str(model_dir), model_name="m", engine={"threads": 1},
                          generation={"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 160,
                                      "kv_cache_tokens": 1024, "block_size": 4, "cache_entries": 0})
    sock = str(tmp_path / "engine.sock")
    procs = []

    def start():
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        p = subprocess.Popen([sys.executable, "-m", "surge.cli.workers", "engine", child_config(config), sock],
                             env=env)
        procs.append(p)
        return p

    yield start, sock, config
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def _front(sock, config):
    from surge.runtime.generate_hub import HubClient
    from surge.runtime.generate_load import service_over
    from surge.runtime.loader import generate_settings
    from surge.models import load_model_spec

    spec = load_model_spec(config.model_dir, name="m")
    _, _, gen = generate_settings(spec, config.engine, config.generation)
    s = service_over(HubClient(sock, timeout_s=120), spec.path, "m", "1", gen, 60)
    s.mark_ready()
    return s


def _hf_greedy(hf, ids, n):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


TEXTS = ["Define assignment.", "The augmented assignment statement", "Python", "a b c d e f g h i j k l m n",
         "What is a variable?", "Loops repeat"]


async def _tokens(svc, prompt, n):
    ids = []
    async for d in svc.stream(prompt, SamplingParams(max_tokens=n, **GREEDY)):
        ids.extend(d.token_ids)
    return ids


def test_two_front_ends_share_the_engine_without_mixing(hub, hf):
    start, sock, config = hub
    start()
    a, b = _front(sock, config), _front(sock, config)
    assert a.remote and not a._engine_metrics and a.engine.pid == b.engine.pid != os.getpid()
    prompts = [a.encode(t) for t in TEXTS]

    async def main():
        # both front ends number their sequences 1, 2, ...: the same ids reach the engine from both
        runs = [_tokens(a, p, 8 + i) for i, p in enumerate(prompts)] + \
               [_tokens(b, p, 14 - i) for i, p in enumerate(reversed(prompts))]
        out = await asyncio.gather(*runs)
        await a.close()
        await b.close()
        return out

    out = asyncio.run(main())
    expect = [_hf_greedy(hf, p, 8 + i) for i, p in enumerate(prompts)] + \
             [_hf_greedy(hf, p, 14 - i) for i, p in enumerate(reversed(prompts))]
    assert out == expect


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_front_end_that_leaves_frees_its_sequences(hub, hf, how):
    """close: the front end unloads the model; drop: its connection ends with nothing said (its
    process died). The leave happens with the engine process stopped (SIGSTOP), so the steps it runs
    after are counted exactly, whatever this machine's speed: the leaver's three 150-token sequences
    stop at once and only the neighbour's 100-token stream is finished."""
    import select

    start, sock, config = hub
    start()
    a, b = _front(sock, config), _front(sock, config)
    prompts = [a.encode(t) for t in TEXTS[:3]]

    async def main():
        long = [asyncio.ensure_future(_tokens(a, p, 150)) for p in prompts]
        got_b: list[int] = []

        async def neighbour():
            async for d in b.stream(prompts[0], SamplingParams(max_tokens=100, **GREEDY)):
                got_b.extend(d.token_ids)

        mine = asyncio.ensure_future(neighbour())
        end = time.monotonic() + 60
        while b.stats()["running"] < 4 and time.monotonic() < end:  # all four decoding
            await asyncio.sleep(0.005)
        os.kill(b.engine.pid, signal.SIGSTOP)
        try:
            while select.select([b.engine.conn], [], [], 0)[0]:  # every report it sent is read
                await asyncio.sleep(0.005)
            for _ in range(5):
                await asyncio.sleep(0)  # and handed to the streams
            full = b.stats()
            assert full["running"] == 4, full  # all four still decoding when it stopped
            done_b = len(got_b)
            if how == "close":  # a front end unloading: its message reaches the stopped engine
                closing = asyncio.ensure_future(a.close())
                await asyncio.sleep(0)
            else:
                a._closed = True  # no restart: this "process" is gone
                with socket.socket(fileno=os.dup(a.engine.conn.fileno())) as cut:
                    cut.shutdown(socket.SHUT_RDWR)  # the connection ends, nothing said
        finally:
            os.kill(b.engine.pid, signal.SIGCONT)
        if how == "close":
            await closing
            for t in long:
                with pytest.raises(NotReady):
                    await t
        else:
            for t in long:
                t.cancel()
        await mine
        while b.stats()["running"] and time.monotonic() < end:
            await asyncio.sleep(0.01)
        after = b.stats()
        await b.close()
        return full, done_b, list(got_b), after

    full, done_b, got, after = asyncio.run(main())
    assert got == _hf_greedy(hf, prompts[0], 100)  # its neighbour's stream is unchanged
    assert after["running"] == 0 and after["waiting"] == 0
    assert after["free_blocks"] > full["free_blocks"] and after["kv_usage"] == 0
    # after the stop: the iteration under way, then only the neighbour's remaining tokens; the leaver's
    # three, left running, would need ~50 steps more than that
    assert after["steps"] - full["steps"] <= (100 - done_b) + 2, (after, full, done_b)


def test_engine_sigterm_fails_streams_and_front_ends_reconnect(hub, hf):
    start, sock, config = hub
    first = start()
    a, b = _front(sock, config), _front(sock, config)
    prompt = a.encode(TEXTS[1])

    async def main():
        runs = [asyncio.ensure_future(_tokens(s, prompt, 150)) for s in (a, b)]
        end = time.monotonic() + 60
        while a.stats()["running"] < 2 and time.monotonic() < end:
            await asyncio.sleep(0.01)
        first.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        for r in runs:
            with pytest.raises(NotReady, match="unloaded"):
                await r
        failed_in = time.monotonic() - t0
        assert await asyncio.to_thread(first.wait, 30) == 0
        while (a.ready or b.ready) and time.monotonic() < end:  # the connections' end is read after the errors
            await asyncio.sleep(0.01)
        assert not a.ready and not b.ready
        second = start()  # the supervisor's part: the engine process again
        while not (a.ready and b.ready) and time.monotonic() < end + 60:
            await asyncio.sleep(0.05)
        assert a.ready and b.ready and a.engine.pid == b.engine.pid == second.pid
        out = await asyncio.gather(_tokens(a, prompt, 12), _tokens(b, prompt, 12))
        await a.close()
        await b.close()
        return failed_in, out

    failed_in, out = asyncio.run(main())
    assert failed_in < 20  # at once, not at the 60 s deadline
    assert out == [_hf_greedy(hf, prompt, 12)] * 2


def test_front_ends_reconnect_whatever_the_restart_limit_and_unload_while_it_is_away(hub, hf, monkeypatch):
    """The supervisor restarts a shared engine process as often as it dies, and each front end reconnects every
    time (GenerateService's own limit is for an engine process of its own); a front end that unloads while the
    engine process is away stops waiting for it at once."""
    from surge.runtime import generate_restart

    monkeypatch.setattr(generate_restart, "RESTART_LIMIT", 1)
    start, sock, config = hub
    proc = start()
    a = _front(sock, config)
    prompt = a.encode(TEXTS[2])

    async def main():
        nonlocal proc
        end = time.monotonic() + 120
        for _ in range(2):  # twice: past the limit of 1
            assert await _tokens(a, prompt, 6) == _hf_greedy(hf, prompt, 6)
            proc.kill()
            await asyncio.to_thread(proc.wait, 30)
            while a.ready and time.monotonic() < end:
                await asyncio.sleep(0.01)
            proc = start()
            while not a.ready and time.monotonic() < end:
                await asyncio.sleep(0.05)
            assert a.ready and a.engine.pid == proc.pid
        assert await _tokens(a, prompt, 6) == _hf_greedy(hf, prompt, 6)
        proc.kill()  # and this time nobody starts it again: the front end unloads meanwhile
        await asyncio.to_thread(proc.wait, 30)
        while a.ready and time.monotonic() < end:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.7)  # its first reconnect attempt is under way
        t0 = time.monotonic()
        await a.close()
        return time.monotonic() - t0, a._restart_task.done()

    took, done = asyncio.run(main())
    assert done and took < 20  # not the 60 s close() allows a restart, nor the 120 s connect timeout


@pytest.fixture
def bare_hub(tmp_path, monkeypatch):
    """(a Hub with no engine behind it, its socket path), the key set for this test."""
    from surge.runtime import generate_hub as gh

    monkeypatch.setenv(gh.AUTHKEY_ENV, secrets.token_hex(32))
    path = str(tmp_path / "hub.sock")
    stop_r, stop_w = os.pipe()
    hub = gh.Hub(gh.listen(path), gh.authkey(), ("ready", None, None, os.getpid()), stop_r)
    yield hub, path
    hub.close()
    os.close(stop_r)
    os.close(stop_w)


def _connect(hub, path, key: bytes):
    """A front end's Client() (on a thread) while the hub accepts it: the connection, or what it raised."""
    import threading
    from multiprocessing.connection import Client

    box = []

    def connect():
        try:
            box.append(Client(path, family="AF_UNIX", authkey=key))
        except Exception as exc:  # noqa: BLE001 - what the test asserts on
            box.append(exc)

    t = threading.Thread(target=connect)
    t.start()
    while t.is_alive():
        hub.drain()  # accepts, and runs the handshake with the client's thread
    t.join()
    return box[0]


def test_a_front_end_that_stops_reading_never_blocks_the_engine_loop(bare_hub, monkeypatch):
    """The hub alone (no engine): a front end that stops reading its socket (a stopped process) does
    not block the hub's sends, which the engine loop makes between its steps; what its socket does not
    take is kept for it, and once it is MAX_BACKLOG behind it counts as gone: its sequences are
    aborted at the next drain. A front end that reads gets every message meanwhile."""
    from surge.runtime import generate_hub as gh
    from surge.runtime.generate_core import EngineState
    from surge.runtime.generate_process import _dumps, _loads
    from surge.runtime.scheduler import Sequence

    monkeypatch.setattr(gh, "MAX_BACKLOG", 1 << 20)
    hub, path = bare_hub

    def connect():
        conn = _connect(hub, path, gh.authkey())
        assert conn.recv()[0] == "ready"
        return conn

    stalled, reader = connect(), connect()
    params = SamplingParams(max_tokens=4, **GREEDY)
    for conn in (stalled, reader):  # both number their 500 sequences 1..500
        conn.send_bytes(_dumps(("add", [Sequence(i, [3, 4, 5], params) for i in range(1, 501)])))
    added = []
    while len(added) < 1000:
        added += [s.seq_id for m in hub.drain() if m[0] == "add" for s in m[1]]
    assert len(set(added)) == 1000  # the hub's own ids
    got = []
    batch = [({gid: 7 for gid in added}, None, None)]  # every sequence samples a token each iteration
    sends = 0
    stalled_front, _ = hub.fronts.values()  # in the order they connected
    while not stalled_front.dead:
        hub.tokens(batch, {}, EngineState(running=1000))  # returns at once whatever the stalled one does
        sends += 1
        assert sends < 10_000
        while reader.poll(0):  # the other front end reads as it goes
            got.append(_loads(reader.recv_bytes()))
    aborted = [m[1] for m in hub.drain() if m[0] == "abort"]
    assert len(aborted) == 500 and stalled_front.fd not in hub.fronts and set(aborted) < set(added)
    hub.tokens(batch, {}, EngineState(running=500))
    while len(got) < sends + 1 and reader.poll(5):
        got.append(_loads(reader.recv_bytes()))
    tokens = [m for m in got if m[0] == "tokens"]
    assert len(tokens) == sends + 1  # the reading front end missed nothing, in its own ids
    assert all(sorted(m[1][0][0]) == list(range(1, 501)) for m in tokens)


def _repository_build(model_dir, tmp_path, monkeypatch):
    """A decoder version's build as a repository's engine process makes it (cli/workers_generate.HubBuild)."""
    from surge.cli.workers_generate import HubBuild
    from surge.config import EngineConfig, GenerationConfig
    from surge.models import load_model_spec
    from surge.runtime.generate_hub import AUTHKEY_ENV

    monkeypatch.setenv(AUTHKEY_ENV, secrets.token_hex(32))
    gen = GenerationConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=160, kv_cache_tokens=1024,
                           block_size=4, cache_entries=0)
    return HubBuild(load_model_spec(model_dir, name="m"), "1", EngineConfig(threads=1), gen, str(tmp_path), 60.0)


async def _streaming_front(build, text: str, n: int):
    """A front end of `build` whose n-token stream is running in the build's engine: (front end, prompt,
    the stream's task)."""
    from types import SimpleNamespace

    from surge.cli.workers_generate import front_generator
    from surge.config import CacheConfig

    config = SimpleNamespace(limits=SimpleNamespace(request_timeout_s=60.0), cache=CacheConfig())
    svc = await front_generator(config, build.catalog_entry())
    svc.mark_ready()
    prompt = svc.encode(text)
    run = asyncio.ensure_future(_tokens(svc, prompt, n))
    end = time.monotonic() + 60
    while svc.stats()["running"] == 0 and time.monotonic() < end:
        await asyncio.sleep(0.01)
    return svc, prompt, run


def test_a_repository_build_closes_only_after_its_front_ends_leave(model_dir, hf, tmp_path, monkeypatch):
    """cli/workers_generate.py: a decoder version's build (its engine loop in a process of its own, behind
    its own socket) asked to close while a front end streams through it keeps serving until that
    front end has retired it (its stream whole), then ends and removes its socket."""
    from surge.cli.workers_generate import retire

    build = _repository_build(model_dir, tmp_path, monkeypatch)
    build.mark_ready()
    entry = build.catalog_entry()

    async def main():
        svc, prompt, run = await _streaming_front(build, TEXTS[0], 120)
        closing = asyncio.ensure_future(build.close())
        got = await run
        await asyncio.sleep(0.2)
        waited = not closing.done()  # the front end is still connected
        await retire(svc)
        await asyncio.wait_for(closing, 30)
        return prompt, got, waited

    prompt, got, waited = asyncio.run(main())
    assert got == _hf_greedy(hf, prompt, 120)  # not cut by the close
    assert waited and not os.path.exists(entry["hub"])


def test_a_repository_build_whose_process_dies_is_started_again(model_dir, hf, tmp_path, monkeypatch):
    """A decoder build's engine process killed: started again on the same socket, and its front end,
    having failed the stream in flight at once, reconnects and serves transformers' tokens."""
    from surge.cli.workers_generate import retire
    from surge.errors import EngineError

    build = _repository_build(model_dir, tmp_path, monkeypatch)
    first = build.pid

    async def main():
        svc, prompt, run = await _streaming_front(build, TEXTS[3], 150)
        end = time.monotonic()
        os.kill(first, signal.SIGKILL)
        with pytest.raises(EngineError):
            await run
        while not svc.ready and time.monotonic() < end + 60:
            await asyncio.sleep(0.05)
        assert svc.ready and svc.engine.pid == build.pid != first
        got = await _tokens(svc, prompt, 12)
        await retire(svc)
        await build.close()
        return prompt, got

    prompt, got = asyncio.run(main())
    assert got == _hf_greedy(hf, prompt, 12)
    assert not os.path.exists(build.path)


def test_a_connection_that_stalls_in_the_handshake_does_not_hold_the_hub(bare_hub, monkeypatch):
    """A connection that sends nothing (a front end stopped while it connects) is dropped after HANDSHAKE_S;
    a wrong key is refused; a real front end connects after both."""
    from surge.runtime import generate_hub as gh

    monkeypatch.setattr(gh, "HANDSHAKE_S", 0.3)
    hub, path = bare_hub
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(path)
        assert hub.drain() == []  # accepts it, waits HANDSHAKE_S for its answer, drops it
        assert not hub.fronts  # (without the bound drain() would never return: the test hangs)
    refused = _connect(hub, path, secrets.token_bytes(32))
    assert isinstance(refused, Exception) and not hub.fronts
    conn = _connect(hub, path, gh.authkey())
    assert len(hub.fronts) == 1 and conn.recv()[0] == "ready"
    conn.close()


def test_the_hubs_wait_says_whether_something_came(bare_hub):
    """Hub.wait(timeout) (the engine loop's wait, which an arrival cuts short while launches are in flight): False
    after the timeout with nothing to read, True at once when a front end has sent something."""
    import time

    from surge.runtime import generate_hub as gh
    from surge.runtime.generate_process import _dumps
    from surge.runtime.scheduler import Sequence

    hub, path = bare_hub
    conn = _connect(hub, path, gh.authkey())
    assert conn.recv()[0] == "ready"
    hub.drain()
    t = time.perf_counter()
    assert hub.wait(0.0002) is False and time.perf_counter() - t >= 0.0009  # poll's unit: rounded up to 1 ms
    conn.send_bytes(_dumps(("add", [Sequence(1, [3, 4, 5], SamplingParams(max_tokens=2, **GREEDY))])))
    t = time.perf_counter()
    assert hub.wait(5.0) is True and time.perf_counter() - t < 4.0
    assert [m[0] for m in hub.drain()] == ["add"]

"""A repository decoder build under `--workers` (cli/workers_generate.HubBuild): real build processes.

- a build whose process comes back later than a front end's reconnect attempts last (a large model
  loads for minutes; the front end's attempts wait 30 s each) is served again by that front end once it
  is up: the engine is the build's to restart, so the front end never gives up on it while it routes it;
- its engine-wide gauges leave /metrics with its processes.

The build's process exports the engine's gauges (running / waiting sequences, KV cache use) in
prometheus_client's multiprocess files as `livemax`: the max over processes that are alive, which
holds only if a process that ends has its files removed (mark_process_dead). The supervisor does
that for its own children; a build's process is the engine process's child, so HubBuild must. A
real build process (killed mid-stream, started again, then closed) and the files read as /metrics
reads them.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import prometheus_client  # noqa: F401 - imported before the test sets PROMETHEUS_MULTIPROC_DIR: this
import pytest  # process's own metrics stay in memory, and the files are the build processes' alone

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.decoder_models import build_model  # noqa: E402
from tests.unit.test_generate_hub import TEXTS, _repository_build, _streaming_front, _tokens  # noqa: E402

GAUGES = ("surge_generate_running_sequences", "surge_generate_waiting_sequences",
          "surge_generate_kv_cache_usage_ratio")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("hubm") / "q", seed=9)


def _gauges(path) -> dict:
    """{(name, version): value} of the engine gauges, as a front end's /metrics sums the files."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry()
    MultiProcessCollector(reg, str(path))
    return {(s.name, s.labels.get("version")): s.value for fam in reg.collect() for s in fam.samples
            if s.name in GAUGES}


def test_a_front_end_waits_for_a_build_that_comes_back_late(model_dir, tmp_path, monkeypatch):
    from surge.cli import workers_generate
    from surge.cli.workers_generate import retire
    from surge.errors import EngineError
    from surge.runtime import generate_restart
    from surge.runtime.generate_hub import HubClient

    # scaled down: the build restarts after 12 s, the front end's attempts give up after ~5 s in all
    monkeypatch.setattr(workers_generate, "RESTART_DELAYS_S", (12.0,))
    monkeypatch.setattr(generate_restart, "RESTART_DELAYS_S", (0.2, 0.5, 1.0))
    build = _repository_build(model_dir, tmp_path, monkeypatch)
    first = build.pid

    async def main():
        svc, prompt, run = await _streaming_front(build, TEXTS[0], 150)
        svc.engine.timeout_s = 1.0  # each reconnect attempt's wait (30 s in front_generator)
        os.kill(first, signal.SIGKILL)
        with pytest.raises(EngineError):
            await run
        probe = await asyncio.to_thread(HubClient, build.path, 120.0)  # the build serves again (a new front end
        back = probe.pid == build.pid != first                         # connects), so must the one it had
        probe.close()
        end = time.monotonic() + 60
        while not svc.ready and time.monotonic() < end:
            await asyncio.sleep(0.05)
        got = await _tokens(svc, prompt, 4) if svc.ready else None
        await retire(svc)
        await build.close()
        return back, got

    back, got = asyncio.run(main())
    assert back
    assert got is not None and len(got) == 4


def test_a_builds_gauges_leave_metrics_with_its_processes(model_dir, tmp_path, monkeypatch):
    from surge.cli.workers_generate import retire
    from surge.errors import EngineError

    files = tmp_path / "metrics"
    files.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(files))  # the build's process writes here
    build = _repository_build(model_dir, tmp_path, monkeypatch)
    first = build.pid

    async def main():
        svc, prompt, run = await _streaming_front(build, TEXTS[3], 150)
        running = _gauges(files).get(("surge_generate_running_sequences", "1"))
        os.kill(first, signal.SIGKILL)  # with a sequence running: its file says so
        with pytest.raises(EngineError):
            await run
        end = time.monotonic() + 60
        while not svc.ready and time.monotonic() < end:
            await asyncio.sleep(0.05)
        assert svc.ready and build.pid != first
        await _tokens(svc, prompt, 4)  # the new process serves
        await retire(svc)
        await build.close()
        return running

    running = asyncio.run(main())
    assert running is not None and running >= 1
    # both processes ended: an unloaded version's engine has no gauges (not the dead one's last values)
    assert _gauges(files) == {}

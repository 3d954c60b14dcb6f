"""`surge bench` end to end: real `surge serve` processes, the CLI, an in-process engine, a killed server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from surge.bench.loadgen import LoadSpec, run_load
from surge.bench.targets import InProcess, NativeHTTP, OpenAIHTTP
from surge.bench.workloads import make_workload
from tests.server_process import ROOT, ServerProcess


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--threads", "1") as srv:
        yield srv


def _valid_png(path: Path) -> None:
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as im:
        im.verify()


def test_cli_run_writes_json_and_plots(server, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "surge.cli.main", "bench", "run", server.url, "-c", "1,4", "--duration", "1.0",
         "--warmup", "0.2", "--queries", "2000", "--json", str(tmp_path / "r.json"), "--plots", str(tmp_path),
         "--no-progress"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    runs = doc["runs"][server.url]
    assert [r["concurrency"] for r in runs] == [1, 4]
    for r in runs:
        assert r["ok"] == r["requests"] > 0 and r["errors"] == {}
        assert r["throughput_rps"] == pytest.approx(r["ok"] / r["window_s"])
        lat = r["latency_ms"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p99.9"] <= lat["max"]
    assert doc["workload"]["distinct_queries"] == 2000
    for name in ("bench_latency_cdf.png", "bench_latency_vs_throughput.png", "bench_cache_hit_vs_size.png"):
        _valid_png(tmp_path / name)


def test_open_loop_rate_against_a_real_server(server):
    rate, duration = 50.0, 2.0
    r = asyncio.run(run_load(OpenAIHTTP(server.url), make_workload(2000).stream(seed=2),
                             LoadSpec(mode="open", rate=rate, duration_s=duration, warmup_s=0.5, concurrency=16,
                                      seed=9)))
    assert abs(r.count - rate * duration) < 4 * np.sqrt(rate * duration)
    assert r.ok.all(), r.errors


def test_a_server_killed_mid_run_is_reported():
    srv = ServerProcess("--threads", "1").start()
    try:
        async def main():
            loop = asyncio.get_running_loop()
            loop.call_later(1.5, os.killpg, srv.proc.pid, signal.SIGKILL)
            return await run_load(NativeHTTP(srv.url, timeout_s=5), make_workload(2000).stream(seed=3),
                                  LoadSpec(mode="open", rate=30, duration_s=3.0, warmup_s=0.0, concurrency=8))

        r = asyncio.run(main())
    finally:
        srv.stop()
    errors = r.errors
    assert r.ok.sum() > 10  # it served before it died...
    assert sum(errors.values()) > 20  # ...and everything after is reported, by kind
    assert set(errors) <= {"connect", "disconnect"}, errors
    assert int(r.ok.sum()) + sum(errors.values()) == r.count
    # Failures come after successes: nothing was "ok" once the server was gone.
    assert r.scheduled[r.ok].max() < r.scheduled[~r.ok].min() + 1.0


def test_in_process_engine_at_the_asked_rate(bundled_spec, bundled_worker):
    from surge.runtime.service import ModelService

    service = ModelService(bundled_spec.name, "1", bundled_worker)
    service.mark_ready()
    rate, duration = 50.0, 3.0

    text = make_workload(2000).queries[0]

    async def main():
        load = await run_load(InProcess(service), make_workload(2000).stream(seed=4),
                              LoadSpec(mode="open", rate=rate, duration_s=duration, warmup_s=0.3, seed=5,
                                       inputs_per_request=2))
        # A service's batcher lives on the loop that first used it: spot-check on the same loop.
        return load, (await service.embed(texts=[text])).vectors[0]

    r, v = asyncio.run(main())
    assert r.ok.all(), r.errors
    assert abs(r.count - rate * duration) < 4 * np.sqrt(rate * duration)
    # The worker directly (no service, no asyncio in the engine path), closed loop, bounded by count.
    r = asyncio.run(run_load(InProcess(bundled_worker), make_workload(2000).stream(seed=6),
                             LoadSpec(mode="closed", concurrency=2, duration_s=30, warmup_s=0, max_requests=20)))
    assert r.count == 20 and r.ok.all(), r.errors
    # In-process requests still return real embeddings: the same vector the engine gives directly.
    from surge.types import EmbedOptions

    direct = bundled_worker.finish(bundled_worker.compute(bundled_worker.tokenizer.encode([text])), EmbedOptions())[0]
    np.testing.assert_allclose(v, direct, atol=1e-5)
    assert np.linalg.norm(v) == pytest.approx(1.0, abs=1e-4)


def test_compare_script_runs_both_servers(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "serving_vs_baseline.py"), "--clients", "1,2", "--duration",
         "0.7", "--warmup", "0.2", "--plots", str(tmp_path), "--json", str(tmp_path / "c.json"),
         "--markdown", str(tmp_path / "t.md"), "--no-progress", "--surge-flag=--threads", "--surge-flag=1"],
        capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    table = (tmp_path / "t.md").read_text()
    assert "| 1 clients |" in table and "| 2 clients |" in table
    doc = json.loads((tmp_path / "c.json").read_text())
    assert set(doc["runs"]) == {"baseline", "surge"}
    assert all(r["ok"] > 0 and r["error_count"] == 0 for rs in doc["runs"].values() for r in rs)
    _valid_png(tmp_path / "bench_latency_vs_throughput.png")

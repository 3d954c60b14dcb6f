"""`surge bench` end to end: real `surge serve` processes, the CLI, an in-process engine, a killed server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
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
    # The command is recorded with the machine, and the printed table keeps every digit (not "122…").
    command = doc["environment"]["command"]
    assert "bench run" in command and server.url in command and "-c 1,4" in command
    for r in runs:
        assert f"{r['throughput_rps']:.1f}" in out.stdout and f"{r['latency_ms']['p99']:.1f}" in out.stdout
    for name in ("bench_latency_cdf.png", "bench_latency_vs_throughput.png", "bench_cache_hit_vs_size.png"):
        _valid_png(tmp_path / name)


def test_open_loop_rate_against_a_real_server(server):
    rate, duration = 50.0, 2.0
    r = asyncio.run(run_load(OpenAIHTTP(server.url), make_workload(2000).stream(seed=2),
                             LoadSpec(mode="open", rate=rate, duration_s=duration, warmup_s=0.5, concurrency=16,
                                      seed=9)))
    assert abs(r.count - rate * duration) < 4 * np.sqrt(rate * duration)
    assert r.ok.all(), r.errors


def test_open_loop_concurrency_is_a_cap_on_requests_in_flight(server, tmp_path):
    # `-c` in open loop is the most requests in flight (it was silently replaced by --connections): every
    # scheduled arrival is accounted for, sent (and answered) or dropped at the cap, and the JSON says the cap.
    rate, duration = 100.0, 1.0
    out = _bench_cli("run", server.url, "--mode", "open", "--rate", str(rate), "-c", "1", "-d", str(duration),
                     "--warmup", "0.2", "--max-error-rate", "1", "--json", str(tmp_path / "r.json"), "--no-progress")
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = json.loads((tmp_path / "r.json").read_text())["runs"][server.url]
    assert run["max_inflight"] == 1 and run["error_count"] == 0, run
    assert run["ok"] + run["dropped"] == run["requests"] > 0
    assert abs(run["requests"] - rate * duration) < 4 * np.sqrt(rate * duration)  # the asked arrivals, all of them
    assert ("dropped" in out.stdout) == (run["dropped"] > 0)


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


def test_server_metrics_exclude_the_warm_up(server):
    # The cache hit ratio and batch sizes read from /metrics cover the measured requests, not the warm-up
    # ones (whose cold cache would pull the hit ratio down): with one client, only the request crossing the
    # boundary (either way: the counters are read while the load goes on) is off.
    from surge.bench.runner import run_sweep

    spec = LoadSpec(mode="closed", concurrency=1, duration_s=0.6, warmup_s=0.6, seed=1)
    [r] = asyncio.run(run_sweep(lambda: NativeHTTP(server.url), make_workload(2000), [spec],
                                metrics_url=server.url))
    assert r.warmup_requests > 5 and r.ok.all()
    seen = r.metrics["cache_hits"] + r.metrics["cache_misses"]
    assert abs(seen - r.count) <= 1, (seen, r.count, r.warmup_requests)


def _cli(*args):
    from typer.testing import CliRunner

    from surge.cli.main import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize("flags, says", [
    (["-c", ""], "--concurrency"), (["-c", ","], "--concurrency"),
    (["--mode", "open", "--rate", ","], "--rate"),
    (["--requests", "-1"], "--requests"), (["--warmup", "-1"], "--warmup"),
    (["--timeout", "0"], "--timeout"), (["--mode", "replay", "--replay-speed", "0"], "--replay-speed"),
])
def test_bad_flags_are_clear_errors(flags, says):
    from surge.bench.servers import free_port

    res = _cli("bench", "run", f"http://127.0.0.1:{free_port()}", "-d", "0.3", "--warmup", "0", *flags,
               "--no-progress")
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert says in res.output and "Traceback" not in res.output


def test_compare_needs_distinct_names():
    res = _cli("bench", "compare", "-t", "a=http://127.0.0.1:1", "-t", "a=http://127.0.0.1:2", "--no-progress")
    assert res.exit_code == 2 and "'a'" in res.output, res.output


def _bench_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "surge.cli.main", "bench", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, check=False)


def test_a_target_that_does_not_answer_is_a_clear_error():
    from surge.bench.servers import free_port

    url = f"http://127.0.0.1:{free_port()}"
    out = _bench_cli("run", url, "-d", "1", "--warmup", "0", "--no-progress")
    assert out.returncode == 1
    text = out.stdout + out.stderr
    assert "Traceback" not in text
    # What failed and why, in full (the table's error column is cut to fit a terminal).
    assert f"{url}: connect" in text and "refused" in text.lower(), text


def test_a_target_that_answers_errors_is_a_clear_error(server):
    out = _bench_cli("run", server.url + "/nope", "-d", "1", "--warmup", "0", "--no-progress")
    text = out.stdout + out.stderr
    assert out.returncode == 1 and "Traceback" not in text
    assert "http_404" in text and "Not Found" in text, text


def test_ctrl_c_reports_what_was_measured(server, tmp_path):
    from surge.bench.metrics import parse

    def served():
        import httpx

        m = parse(httpx.get(server.url + "/metrics").text)
        return m["cache_hits"] + m["cache_misses"]

    before = served()
    proc = subprocess.Popen([sys.executable, "-m", "surge.cli.main", "bench", "run", server.url, "-c", "2,4",
                             "-d", "120", "--warmup", "0", "--json", str(tmp_path / "r.json"), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while served() < before + 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out
    assert "interrupted" in out and "Traceback" not in out
    doc = json.loads((tmp_path / "r.json").read_text())
    [run] = doc["runs"][server.url]  # the level under way, cut short; the next one never started
    assert run["concurrency"] == 2 and run["ok"] >= 20 and run["errors"] == {}
    assert run["interrupted"] is True


def test_compare_with_api_key_reaches_keyed_servers_and_their_metrics(tmp_path):
    """`surge bench compare --api-key KEY` (as `bench run`'s): the key goes to every target and to their
    /metrics reads; without it every request of a keyed server is a 401 and the statistics are missing."""
    with ServerProcess("--threads", "1", "--api-key", "KEY") as srv:
        out = subprocess.run(
            [sys.executable, "-m", "surge.cli.main", "bench", "compare", "-t", f"a={srv.url}", "-t", f"b={srv.url}",
             "-c", "2", "-n", "10", "-d", "20", "--warmup", "0", "--queries", "50", "--api-key", "KEY",
             "--json", str(tmp_path / "c.json"), "--no-progress"],
            capture_output=True, text=True, timeout=180, cwd=ROOT)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        runs = json.loads((tmp_path / "c.json").read_text())["runs"]
        assert set(runs) == {"a", "b"}
        for name, [r] in runs.items():
            assert r["ok"] == r["requests"] == 10 and r["errors"] == {}, (name, r)
            assert r["cache_hits"] + r["cache_misses"] >= 10, (name, r)  # b: the same server, its cache warm
        assert runs["a"][0]["batches"] >= 1

"""The load generator against a real (tiny, in-test) HTTP server: rates, counts, queueing, errors."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from scipy import stats

from surge.bench.loadgen import LoadSpec, run_load, sweep_specs
from surge.bench.targets import KServeHTTP, NativeHTTP, OpenAIHTTP
from surge.bench.workloads import make_workload
from tests.unit.bench.tiny_server import TinyServer


@pytest.fixture(scope="module")
def workload():
    return make_workload(2000, seed=0)


def run(target, workload, spec, **kw):
    return asyncio.run(run_load(target, workload.stream(seed=spec.seed), spec, **kw))


def test_open_loop_sends_a_poisson_process_at_the_asked_rate(workload):
    rate, duration = 150.0, 3.0
    with TinyServer() as srv:
        r = run(NativeHTTP(srv.url), workload, LoadSpec(mode="open", rate=rate, duration_s=duration,
                                                        warmup_s=0.5, concurrency=32, seed=7))
        arrivals = np.array(srv.arrivals)
    # Count in the measured window ~ Poisson(rate * duration): within 4 standard deviations.
    mean = rate * duration
    assert abs(r.count - mean) < 4 * np.sqrt(mean), r.count
    assert r.ok.all() and srv.count == r.count + r.warmup_requests
    # Scheduled gaps are exponential with the asked rate (KS test), and they were kept:
    gaps = np.diff(np.sort(r.scheduled))
    assert stats.kstest(gaps, "expon", args=(0, 1 / rate)).pvalue > 1e-3
    assert np.all(r.scheduled >= 0) and np.all(r.scheduled < duration)
    # the server saw the same process (arrival gaps at the server, not just on paper).
    srv_gaps = np.diff(arrivals)
    assert np.mean(srv_gaps) == pytest.approx(1 / rate, rel=0.15)
    assert np.median(r.started - r.scheduled) < 0.05  # the generator kept up


def test_open_loop_latency_counts_queueing_from_the_scheduled_time(workload):
    # One-at-a-time server, 40 ms per request, offered 2x its capacity on ONE connection:
    # waiting for the connection is part of latency (no coordinated omission).
    service, rate = 0.040, 50.0
    with TinyServer(service_s=service, serial=True) as srv:
        r = run(NativeHTTP(srv.url), workload, LoadSpec(mode="open", rate=rate, duration_s=1.5, warmup_s=0.0,
                                                        concurrency=1, seed=3))
    sched = np.sort(r.scheduled)
    # Lindley recursion: the least each request could have waited with a 40 ms server.
    done = np.empty_like(sched)
    prev = -np.inf
    for i, t in enumerate(sched):
        prev = done[i] = max(prev, t) + service
    expected = done - sched
    got = np.sort(r.latency[np.argsort(np.argsort(r.scheduled))])
    assert r.ok.all()
    assert np.mean(r.latency) >= 0.9 * np.mean(expected)
    assert np.max(r.latency) >= 0.9 * np.max(expected) > 0.5  # the queue grew and it shows
    assert got.size == expected.size


def test_closed_loop_count_and_concurrency_are_as_asked(workload):
    with TinyServer(service_s=0.005) as srv:
        r = run(NativeHTTP(srv.url), workload, LoadSpec(mode="closed", concurrency=8, duration_s=30.0,
                                                        warmup_s=0.3, max_requests=300))
        assert r.count == 300 and r.ok.all()
        assert srv.count == r.count + r.warmup_requests and r.warmup_requests > 0
        assert srv.max_inflight == 8  # exactly N clients, never more
        assert r.window_s < 30.0  # stopped by the count, not by the clock


def test_closed_loop_is_bounded_in_time(workload):
    with TinyServer(service_s=0.01) as srv:
        r = run(NativeHTTP(srv.url), workload, LoadSpec(mode="closed", concurrency=4, duration_s=0.8, warmup_s=0.2))
    # 4 clients x 10 ms: ~400 requests/s; the run lasted ~0.8 s, so far fewer than a time-unbounded run.
    assert 0.75 < r.window_s < 2.0
    assert 0 < r.count and r.ok.all()
    assert r.started.max() < 0.8 + 1e-3  # nothing issued after the window


def test_errors_are_counted_by_kind_exactly(workload):
    def flaky(i, path, body):
        if i % 7 == 3:
            return "close"
        if i % 5 == 0:
            return 500, b'{"error": "boom"}'
        if i % 5 == 1:
            return 429, b'{"error": "busy"}'
        if i % 11 == 2:
            return 200, b'{"embeddings": []}'  # wrong row count
        return 200, b'{"embeddings": [[1.0]]}'

    with TinyServer(flaky) as srv:
        r = run(NativeHTTP(srv.url), workload, LoadSpec(mode="closed", concurrency=4, duration_s=30, warmup_s=0,
                                                        max_requests=400))
        seen = dict(srv.statuses)
    errors = r.errors
    assert r.count == 400
    # Every dropped connection, 500 and 429 the server produced is reported, none hidden.
    assert errors.get("http_500") == seen[500] and errors.get("http_429") == seen[429]
    assert errors.get("disconnect") == seen["close"]
    assert errors.get("bad_response", 0) > 0
    assert int(r.ok.sum()) + sum(errors.values()) == r.count


def test_nothing_listening_is_reported(workload):
    from surge.bench.servers import free_port

    r = run(NativeHTTP(f"http://127.0.0.1:{free_port()}"), workload,
            LoadSpec(mode="open", rate=100, duration_s=0.5, warmup_s=0, concurrency=4))
    assert r.count > 20 and not r.ok.any()
    assert set(r.errors) == {"connect"}


def test_timeouts_are_reported(workload):
    with TinyServer(service_s=0.5) as srv:
        target = NativeHTTP(srv.url, timeout_s=0.1)
        r = run(target, workload, LoadSpec(mode="closed", concurrency=2, duration_s=0.5, warmup_s=0))
    assert r.count > 0 and r.errors == {"timeout": r.count}


def test_openai_and_kserve_bodies_follow_their_specs(workload):
    import json

    seen = []

    def answer(i, path, body):
        req = json.loads(body)
        seen.append((path, req))
        if path == "/v1/embeddings":
            return 200, json.dumps({"data": [{"embedding": [0.1], "index": k} for k in range(len(req["input"]))]}).encode()
        inp = req["inputs"][0]
        assert inp["name"] == "text" and inp["datatype"] == "BYTES" and inp["shape"] == [len(inp["data"])]
        return 200, json.dumps({"outputs": [{"name": "embedding", "datatype": "FP32",
                                             "shape": [len(inp["data"]), 1], "data": [0.0] * len(inp["data"])}]}).encode()

    spec = LoadSpec(mode="closed", concurrency=2, duration_s=10, warmup_s=0, max_requests=20, inputs_per_request=3)
    with TinyServer(answer) as srv:
        r1 = run(OpenAIHTTP(srv.url, model="m"), workload, spec)
        r2 = run(KServeHTTP(srv.url, model="mini"), workload, spec)
        r3 = run(OpenAIHTTP(srv.url, model="m", encoding_format="base64"), workload, spec)
    assert r1.ok.all() and r2.ok.all() and r3.ok.all() and r1.count == r2.count == r3.count == 20
    assert {p for p, _ in seen} == {"/v1/embeddings", "/v2/models/mini/infer"}
    formats = [req.get("encoding_format") for p, req in seen if p == "/v1/embeddings"]
    assert formats.count("base64") == 20 and formats.count(None) == 20
    assert all(len(req.get("input", req.get("inputs", [{}])[0].get("data"))) == 3 for _, req in seen)


def test_sweep_specs_vary_the_level():
    specs = sweep_specs(LoadSpec(mode="open", rate=1), [10, 20, 40])
    assert [s.rate for s in specs] == [10, 20, 40] and len({s.seed for s in specs}) == 3
    specs = sweep_specs(LoadSpec(mode="closed"), [1, 16, 64])
    assert [s.concurrency for s in specs] == [1, 16, 64]
    with pytest.raises(ValueError):
        LoadSpec(mode="open", rate=0).validate()
    with pytest.raises(ValueError):
        LoadSpec(mode="closed", duration_s=0).validate()


def test_a_stalled_generator_shows_up_in_latency(workload):
    """If the generator itself falls behind (here its loop is blocked for 0.3 s), the requests it
    sends late carry that delay in their latency: it is measured from the scheduled time."""
    import time

    async def main():
        asyncio.get_running_loop().call_later(0.4, time.sleep, 0.3)
        with TinyServer() as srv:
            return await run_load(NativeHTTP(srv.url), workload.stream(seed=1),
                                  LoadSpec(mode="open", rate=200, duration_s=1.0, warmup_s=0, concurrency=8))

    r = asyncio.run(main())
    lag = r.started - r.scheduled
    assert lag.max() > 0.2  # some requests were sent late...
    assert np.all(r.latency >= lag)  # ...and their latency includes it
    late = lag > 0.1
    assert late.sum() > 10 and np.median(r.latency[late]) > 0.1
    assert r.ok.all()


def test_replay_follows_the_log_times_and_the_count_bound(tmp_path):
    from surge.bench.workloads import poisson_offsets, read_query_log, write_query_log

    texts = make_workload(1000, seed=2).sample(400, seed=3)
    times = poisson_offsets(400, 100.0, seed=4)
    log = read_query_log(write_query_log(tmp_path / "q.jsonl", texts, times))
    seen = []

    def record(i, path, body):
        import json

        seen.append(json.loads(body)["inputs"][0])
        return 200, b'{"embeddings": [[1.0]]}'

    with TinyServer(record) as srv:
        spec = LoadSpec(mode="replay", duration_s=60, warmup_s=0, max_requests=150, concurrency=16)
        r = asyncio.run(run_load(NativeHTTP(srv.url), log.stream(), spec, times=log.times))
    assert r.count == 150 and r.ok.all()
    np.testing.assert_allclose(np.sort(r.scheduled), times[:150], atol=1e-6)  # the log's schedule, kept
    assert sorted(seen) == sorted(texts[:150])  # the log's queries, in its order (up to arrival races)


def test_connections_are_kept_alive_pooled_and_under_the_base_path(workload):
    # 4 closed-loop clients over 200 requests: 4 connections, each reused; a base URL's path prefixes routes.
    with TinyServer() as srv:
        r = run(NativeHTTP(srv.url + "/api/"), workload, LoadSpec(mode="closed", concurrency=4, duration_s=30,
                                                                 warmup_s=0, max_requests=200))
        assert r.ok.all() and r.count == 200
        assert srv.connections == 4
        assert set(srv.paths) == {"/api/embed"}
    # A model name that a URL must encode is sent encoded (the request line stays valid).
    def infer(i, path, body):
        return 200, b'{"outputs": [{"name": "embedding", "shape": [1, 1], "datatype": "FP32", "data": [0.5]}]}'

    with TinyServer(infer) as srv:
        r = run(KServeHTTP(srv.url, model="my model"), workload,
                LoadSpec(mode="closed", concurrency=1, duration_s=10, warmup_s=0, max_requests=3))
        assert r.ok.all() and set(srv.paths) == {"/v2/models/my%20model/infer"}


def test_a_target_needs_an_http_url():
    with pytest.raises(ValueError, match="http"):
        asyncio.run(NativeHTTP("ftp://127.0.0.1:21").open(1))


def _self_signed(tmp_path):
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "surge test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def test_https_targets_check_the_certificate(workload, tmp_path, monkeypatch):
    import ssl

    cert, key = _self_signed(tmp_path)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    spec = LoadSpec(mode="closed", concurrency=2, duration_s=10, warmup_s=0, max_requests=40)
    with TinyServer(ssl=ctx) as srv:
        assert srv.url.startswith("https://")
        untrusted = run(NativeHTTP(srv.url), workload, spec)  # a certificate no CA of the system signed
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        trusted = run(NativeHTTP(srv.url), workload, spec)
    assert not untrusted.ok.any() and set(untrusted.errors) == {"connect"}
    assert trusted.ok.all() and trusted.count == 40


def test_a_cancelled_request_does_not_leave_its_connection_in_the_pool():
    # The answer to a cancelled request may still arrive: that connection must not carry the next request.
    async def main(srv):
        target = NativeHTTP(srv.url)
        await target.open(1)
        first = asyncio.ensure_future(target.send(["cancelled"]))
        await asyncio.sleep(0.1)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.5)  # the server answers the cancelled request, then finds its connection closed
        ended = srv.ended
        await target.send(["next"])  # raises on a wrong answer (row count) or a failure
        await target.close()
        return ended

    with TinyServer(service_s=0.3) as srv:
        ended_before_next = asyncio.run(main(srv))
        assert ended_before_next == 1  # closed at once, not left open beside the pool
        assert srv.connections == 2 and srv.count == 2


def test_the_generators_own_cpu_is_reported(workload):
    """CPU time of the generator's process a request sent, and in cores: a target that burns >= 2 ms of CPU a
    request reads at least that; the raw HTTP client against a tiny server (in this process: its CPU counts
    too), far less."""
    import time

    from surge.bench.report import summarize, table

    class Burner:
        name = "burner"

        async def open(self, connections):
            pass

        async def send(self, texts):
            t = time.thread_time()
            while time.thread_time() - t < 0.002:
                pass
            await asyncio.sleep(0)

        async def close(self):
            pass

    spec = LoadSpec(mode="closed", concurrency=2, duration_s=30, warmup_s=0.1, max_requests=150)
    burn = summarize(run(Burner(), workload, spec))
    assert burn["generator_cpu_ms_per_request"] >= 2.0
    # One busy thread: never more than a core (plus the loop's own work); how much less depends on the machine.
    assert 0 < burn["generator_cores"] <= 1.2
    with TinyServer() as srv:
        r = run(NativeHTTP(srv.url), workload, spec)
    http = summarize(r)
    assert 0 < http["generator_cpu_ms_per_request"] < burn["generator_cpu_ms_per_request"]
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(table({"http": [r]}))
    assert "gen CPU ms/req" in console.export_text()


def test_closed_loop_throughput_is_completions_per_second_of_the_window(workload):
    # 4 clients against a fixed 200 ms service: the server completes 4 / 0.2 = 20 requests a second, and by
    # Little's law throughput x mean latency = clients. Requests issued late in the window finish after it
    # (the drain) and the first measured ones wait for warm-up answers: dividing the measured requests by
    # "window start -> last completion" under-counted by (D + L/2) / (D + L) (0.86 here).
    concurrency, service = 4, 0.2
    with TinyServer(service_s=service) as srv:
        r = run(NativeHTTP(srv.url), workload, LoadSpec(mode="closed", concurrency=concurrency, duration_s=0.6,
                                                        warmup_s=0.3))
    from surge.bench.report import summarize

    s = summarize(r)
    assert r.ok.all() and s["window_s"] == pytest.approx(0.6, abs=0.05)
    mean_latency = s["latency_ms"]["mean"] / 1000
    assert s["throughput_rps"] * mean_latency == pytest.approx(concurrency, rel=0.1)

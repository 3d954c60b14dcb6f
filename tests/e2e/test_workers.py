"""`surge serve --workers 2`: real processes (supervisor, two front ends, one engine process).

Results match the FP32 reference under concurrency with no mixing; a killed
engine process fails the requests it held with 503 at once (nothing hangs)
and comes back; a killed front end is started again; SIGTERM drains.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import numpy as np
import psutil
import pytest

from tests.conftest import cosine_rows
from tests.server_process import ServerProcess, children_by_role, fresh_client, wait_ready

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--workers", "2", "--engine", "torch", "--device", "cpu", "--cache-bytes", "0",
                       "--max-batch-size", "16", grpc=True) as srv:
        yield srv


async def _many(url, texts, timeout=60.0, native=False):
    """native: POST /embed, which truncates long inputs (OpenAI's route refuses them with 400)."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
        async def one(t):
            try:
                r = await (c.post("/embed", json={"inputs": t}) if native else
                           c.post("/v1/embeddings", json={"input": t}))
            except httpx.TransportError as exc:  # connection refused or cut: status 0
                return 0, repr(exc), {}
            return r.status_code, (r.json() if r.status_code == 200 else r.text), r.headers
        return await asyncio.gather(*(one(t) for t in texts))


def test_concurrent_results_match_reference_and_never_mix(server, sentences, reference_embed):
    assert len(children_by_role(server)["front"]) == 2 and len(children_by_role(server)["engine"]) == 1
    rng = np.random.default_rng()
    picks = [[sentences[i] for i in rng.choice(len(sentences), int(rng.integers(1, 4)), replace=False)]
             for _ in range(24)]
    # counted from here (the warm-up counts nowhere: tests/e2e/test_metrics_truth.py)
    batches_before = _sample(httpx.get(server.url + "/metrics").text, "surge_batch_size_count")
    out = asyncio.run(_many(server.url, picks))
    uniq = sorted({t for p in picks for t in p})
    ref = {t: v for t, v in zip(uniq, reference_embed(uniq))}
    for texts, (status, body, headers) in zip(picks, out):
        assert status == 200, body
        got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
        assert got.shape[0] == len(texts)
        assert cosine_rows(got, np.stack([ref[t] for t in texts])).min() >= 0.9999
        assert "x-surge-inference-ms" in headers  # the engine process's timings came back
    # /metrics is whole: any front end answers with every process's counts (24 requests in all,
    # the engine process's batches included)
    for _ in range(4):
        text = httpx.get(server.url + "/metrics", headers={"connection": "close"}).text
        assert _sample(text, "surge_requests_total") == len(picks)
        assert _sample(text, "surge_inputs_total") == sum(map(len, picks))
        batches = _sample(text, "surge_batch_size_count") - batches_before
        assert batches >= 1
    # and so are the KServe statistics, whichever front end answers
    for _ in range(4):
        stats = httpx.get(server.url + "/v2/models/all-MiniLM-L6-v2/stats", headers={"connection": "close"}).json()
        (model,) = stats["model_stats"]
        assert model["inference_stats"]["success"]["count"] == len(picks)
        assert model["inference_count"] == sum(map(len, picks))
        # the cache is off, so every request ran the model; requests that shared a batch count one
        # execution (Triton's execution_count counts model runs): the engine process's batches
        assert model["execution_count"] == batches
        assert model["inference_stats"]["compute_infer"]["count"] == len(picks)


def test_grpc_is_served_by_every_front_end_on_one_port(server, sentences, reference_embed):
    """KServe v2 gRPC through the shared port: both front ends listen on it (SO_REUSEPORT), every
    answer matches the FP32 reference, and the engine's build counts reach /metrics."""
    import grpc

    from surge.server.grpc import grpc_service_pb2 as pb
    from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc

    for front in children_by_role(server)["front"]:
        ports = {c.laddr.port for c in front.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
        assert server.grpc_port in ports, ports
    rng = np.random.default_rng()
    texts = [sentences[i] for i in rng.choice(len(sentences), 12, replace=False)]
    ref = reference_embed(texts)
    before = _sample(httpx.get(server.url + "/metrics").text, "surge_requests_total")

    def grpc_successes() -> int:  # Triton's ModelStatistics over gRPC, from whichever front end answers
        with grpc.insecure_channel(server.grpc_url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            reply = stub.ModelStatistics(pb.ModelStatisticsRequest(name="all-MiniLM-L6-v2"), timeout=30)
        return reply.model_stats[0].inference_stats.success.count

    counted = grpc_successes()
    for i, text in enumerate(texts):
        with grpc.insecure_channel(server.grpc_url) as channel:  # a new connection each time
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            assert stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready
            req = pb.ModelInferRequest(model_name="all-MiniLM-L6-v2")
            req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text.encode())
            got = np.frombuffer(stub.ModelInfer(req, timeout=60).raw_output_contents[0], dtype="<f4")
        assert cosine_rows(got[None, :], ref[i:i + 1]).min() >= 0.9999
    text = httpx.get(server.url + "/metrics", headers={"connection": "close"}).text
    assert _sample(text, "surge_requests_total") == before + len(texts)
    assert {grpc_successes() for _ in range(4)} == {counted + len(texts)}
    served = [line for line in text.splitlines() if line.startswith("surge_engine_graph_builds_total{")
              and 'phase="serving"' in line]
    assert served and all(float(line.rsplit(" ", 1)[1]) == 0 for line in served), served


def _sample(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_engine_crash_fails_in_flight_with_503_at_once_and_recovers(server, sentences):
    engine = children_by_role(server)["engine"][0]
    long = [" ".join(sentences[i:i + 12]) for i in range(0, 120, 3)]  # long inputs: the engine is busy a while

    async def main():
        task = asyncio.ensure_future(_many(server.url, [[t] for t in long], timeout=60, native=True))
        await asyncio.sleep(0.5)
        engine.kill()
        t0 = time.monotonic()
        res = await task
        return res, time.monotonic() - t0

    res, took = asyncio.run(main())
    codes = [s for s, _, _ in res]
    assert set(codes) <= {200, 503}, codes
    assert 503 in codes
    assert took < 30  # failed at once, not after the request timeout
    wait_ready(server)
    new = children_by_role(server)["engine"]
    assert len(new) == 1 and new[0].pid != engine.pid
    (status, body, _), = asyncio.run(_many(server.url, [["after the restart"]]))
    assert status == 200, body


def test_crashed_front_end_is_started_again(server):
    old = children_by_role(server)["front"]
    old[0].kill()
    end = time.monotonic() + 60
    while time.monotonic() < end:
        fronts = children_by_role(server)["front"]
        if len(fronts) == 2 and old[0].pid not in {p.pid for p in fronts}:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the front end was not restarted")
    wait_ready(server)
    out = asyncio.run(_many(server.url, [["front end %d" % i] for i in range(8)]))
    assert all(s == 200 for s, _, _ in out), [(s, b) for s, b, _ in out if s != 200]


def test_restarted_front_end_takes_no_connection_before_it_serves(server):
    """While a crashed front end starts again the other one answers /ready 200, so clients (a load
    balancer) keep sending: none of their connections may reach the new process before it serves.
    Made deterministic by holding the new front end's startup (the engine process is stopped, so its
    HELLO never comes) and pausing the other front end, so the new one is the only process that could
    accept: it used to, and answered 503 ("not loaded yet") while a ready front end was there. Now the
    request waits in the shared backlog and is answered 200 once they resume; the held front end does
    not listen on the shared gRPC port either (SO_REUSEPORT would hash connections to it)."""
    import threading

    engine = children_by_role(server)["engine"][0]
    old, other = children_by_role(server)["front"]
    marker = "Waiting for application startup."  # uvicorn's, as the new front end's startup begins
    seen = server.output(tail=1 << 24).count(marker)
    got = {}

    def ask():
        try:
            with fresh_client(server.url, timeout=120) as c:
                r = c.post("/v1/embeddings", json={"input": "held start"})
            got["answer"] = (r.status_code, r.text[:300])
        except httpx.HTTPError as exc:
            got["answer"] = (0, repr(exc))

    engine.suspend()
    asker = threading.Thread(target=ask)
    try:
        old.kill()
        end = time.monotonic() + 60
        while time.monotonic() < end:
            new = [p for p in children_by_role(server)["front"] if p.pid != other.pid]
            if new and new[0].pid != old.pid:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the front end was not restarted")
        other.suspend()  # from here only the new front end could take a connection
        asker.start()
        end = time.monotonic() + 60
        while server.output(tail=1 << 24).count(marker) <= seen and time.monotonic() < end:
            time.sleep(0.05)
        asker.join(2.0)  # its startup has begun (held at HELLO): a front end that accepted has answered
        grpc_ports = {c.laddr.port for c in new[0].net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    finally:
        engine.resume()
        other.resume()
    asker.join(120)
    assert got["answer"][0] == 200, got["answer"]
    assert server.grpc_port not in grpc_ports
    wait_ready(server)


def test_sigterm_drains_in_flight_requests_then_exits(server, sentences):
    texts = [[" ".join(sentences[i:i + 12])] for i in range(0, 48, 3)]  # ~1 s of compute on 2 cores

    async def main():
        task = asyncio.ensure_future(_many(server.url, texts, native=True))
        await asyncio.sleep(0.5)  # all sent and in flight
        server.proc.send_signal(signal.SIGTERM)
        return await task

    out = asyncio.run(main())
    assert server.proc.wait(timeout=60) == 0
    # every request in flight at SIGTERM was answered, none cut off
    codes = [s for s, _, _ in out]
    assert codes == [200] * len(texts), codes


def test_two_engine_processes_each_restarted_on_its_own(sentences, reference_embed):
    """`--engine-processes 2`: front end i talks to engine process i mod 2; answers match the
    reference whichever pair serves them; a killed engine process is started again (the other one
    keeps its pid) and every request answers 200 after."""
    with ServerProcess("--workers", "2", "--engine-processes", "2", "--engine", "torch", "--device", "cpu",
                       "--cache-bytes", "0", "--max-batch-size", "8") as srv:
        kids = children_by_role(srv)
        assert len(kids["engine"]) == 2 and len(kids["front"]) == 2
        rng = np.random.default_rng()
        texts = [sentences[i] for i in rng.choice(len(sentences), 16, replace=False)]
        ref = reference_embed(texts)

        def ask():
            out = []
            for t in texts:  # a new connection each time: the kernel spreads them over the front ends
                with fresh_client(srv.url, timeout=60) as c:
                    out.append(c.post("/v1/embeddings", json={"input": t}))
            return out

        for r, want in zip(ask(), ref):
            assert r.status_code == 200, r.text
            assert cosine_rows(np.array([r.json()["data"][0]["embedding"]], np.float32), want[None]).min() >= 0.9999
        victim, other = kids["engine"]
        victim.kill()
        end = time.monotonic() + 120
        while time.monotonic() < end:
            pids = {p.pid for p in children_by_role(srv)["engine"]}
            if len(pids) == 2 and victim.pid not in pids:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the engine process was not restarted")
        assert other.pid in pids  # the other engine process was left alone
        wait_ready(srv)
        deadline = time.monotonic() + 60
        while True:  # the restarted engine's front end reconnects on its own, shortly after it listens
            codes = [r.status_code for r in ask()]
            if codes == [200] * len(texts) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert codes == [200] * len(texts), codes

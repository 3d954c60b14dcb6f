"""`surge serve MODEL` is a model repository of one entry (cli/single_model.py): the one
lifecycle of runtime/repository.py loads it, reloads it, unloads it, lists it in the KServe
repository index and drains it on SIGTERM, in real server processes with real clients.

- settings: flag > SURGE_* variable > the model.yaml in the model directory > field default;
- statistics: cache hits and real stage durations, over HTTP and gRPC (KServe v2);
- every task kind (embed, classify, token-classify, rerank) of one multi-head model directory
  answers as the transformers / sentence-transformers references do, before and after reloads
  under traffic, and nothing is dropped.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import httpx
import numpy as np
import pytest

from surge.models import bundled_model_dir
from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from tests.conftest import cosine_rows
from tests.server_process import ServerProcess
from tests.task_models import task_models_dir

ENGINE_DELAY_MS = "40"  # every batch takes this long (a test-only setting), so SIGTERM meets work in flight


@pytest.fixture(scope="module")
def mini(tmp_path_factory):
    d = tmp_path_factory.mktemp("single") / "mini"
    d.mkdir()
    (d / "model.yaml").write_text(
        f"source: {bundled_model_dir()}\n"
        "engine: {instances: 2, threads: 1, warmup_shapes: [[1, 8]]}\n"
        "batching: {max_queue_delay_ms: 7, max_batch_size: 16}\n")
    env = {"SURGE_MAX_QUEUE_DELAY_MS": "5", "SURGE_MAX_BATCH_SIZE": "8", "SURGE_TEST_ENGINE_DELAY_MS": ENGINE_DELAY_MS}
    srv = ServerProcess(str(d), "--max-queue-delay-ms", "3", env=env, grpc=True)
    with srv:
        yield srv


def _grpc_embed(stub, text: str) -> np.ndarray:
    req = pb.ModelInferRequest(model_name="mini")
    req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text.encode())
    res = stub.ModelInfer(req, timeout=60)
    return np.frombuffer(res.raw_output_contents[0], dtype="<f4")


def test_flag_beats_variable_beats_model_yaml_beats_default(mini, reference_embed, sentences):
    cfg = httpx.get(mini.url + "/v2/models/mini/config", timeout=30).json()
    assert cfg["dynamic_batching"]["max_queue_delay_microseconds"] == 3000  # flag 3 > variable 5 > model.yaml 7
    assert cfg["max_batch_size"] == 8  # variable 8 > model.yaml 16 > default 64 (engine and batcher alike)
    assert cfg["instance_group"][0]["count"] == 2  # model.yaml 2 > default 1
    r = httpx.post(mini.url + "/embed", json={"inputs": sentences[:3]}, timeout=60)
    assert r.status_code == 200, r.text
    assert cosine_rows(np.asarray(r.json()["embeddings"]), reference_embed(sentences[:3])).min() > 0.99999


def test_statistics_count_cache_hits_and_stage_durations_over_http_and_grpc(mini):
    def stats() -> dict:
        return httpx.get(mini.url + "/v2/models/mini/stats", timeout=30).json()["model_stats"][0]

    text = f"statistics over both protocols {time.time_ns()}"
    with grpc.insecure_channel(mini.grpc_url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        before = stats()
        first = _grpc_embed(stub, text)  # computed
        mid = stats()
        again = _grpc_embed(stub, text)  # from the cache, over gRPC
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]}
        r = httpx.post(mini.url + "/v2/models/mini/infer", json=body, timeout=60)  # from the cache, over HTTP
        assert r.status_code == 200
        grpc_stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="mini"), timeout=30).model_stats[0]
    np.testing.assert_array_equal(first, again)
    after = stats()
    s0, s1, s2 = (x["inference_stats"] for x in (before, mid, after))
    assert mid["execution_count"] == before["execution_count"] + 1
    assert after["execution_count"] == mid["execution_count"]  # the two hits ran nothing
    assert s2["cache_hit"]["count"] == s1["cache_hit"]["count"] + 2 and s1["cache_hit"] == s0["cache_hit"]
    assert s2["cache_miss"]["count"] == s0["cache_miss"]["count"] + 1
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert s1[stage]["count"] == s0[stage]["count"] + 1, stage
        assert s1[stage]["ns"] > s0[stage]["ns"], stage
    # the engine's share is at least the test's engine delay: a real duration, not a placeholder
    assert s1["compute_infer"]["ns"] - s0["compute_infer"]["ns"] >= int(ENGINE_DELAY_MS) * 1e6 * 0.9
    # gRPC's ModelStatistics reads the same numbers
    assert grpc_stats.inference_stats.cache_hit.count == s2["cache_hit"]["count"]
    assert grpc_stats.execution_count == after["execution_count"]


def test_kserve_repository_index_unload_and_load(mini):
    with grpc.insecure_channel(mini.grpc_url) as ch:
        stub = pb_grpc.GRPCInferenceServiceStub(ch)
        index = stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models
        assert [(m.name, m.version, m.state) for m in index] == [("mini", "1", "READY")]
        want = _grpc_embed(stub, "before the unload")
        stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="mini"), timeout=60)
        assert httpx.post(mini.url + "/embed", json={"inputs": ["gone"]}, timeout=30).status_code == 404
        index = httpx.post(mini.url + "/v2/repository/index", json={}, timeout=30).json()
        assert [(m["name"], m["state"]) for m in index] == [("mini", "UNAVAILABLE")]
        with pytest.raises(grpc.RpcError) as err:
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="other"), timeout=30)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "mini" in err.value.details()
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="mini"), timeout=120)  # returns once warm
        np.testing.assert_allclose(_grpc_embed(stub, "before the unload"), want, atol=1e-6)
        # the reloaded copy keeps the merged settings
        cfg = httpx.get(mini.url + "/v2/models/mini/config", timeout=30).json()
        assert cfg["max_batch_size"] == 8 and cfg["instance_group"][0]["count"] == 2


def test_sigterm_drains_requests_in_flight(mini, reference_embed, sentences):
    """Last in this module: it stops the server. Every request sent before SIGTERM is answered, with its own
    embedding (the transformers FP32 reference's)."""
    texts = [f"{sentences[40 + k]} {time.time_ns()}" for k in range(12)]  # fresh: no answer comes from the cache
    statuses: list[int] = []
    answers: dict[int, list[float]] = {}

    async def one(c: httpx.AsyncClient, k: int) -> None:
        r = await c.post("/embed", json={"inputs": [texts[k]]})
        statuses.append(r.status_code)
        if r.status_code == 200:
            answers[k] = r.json()["embeddings"][0]

    async def main():
        async with httpx.AsyncClient(base_url=mini.url, timeout=60) as c:
            tasks = [asyncio.create_task(one(c, k)) for k in range(12)]
            await asyncio.sleep(0.05)  # sent; the engine takes 40 ms a batch
            mini.proc.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks)

    asyncio.run(main())
    assert statuses == [200] * 12, statuses
    got = np.asarray([answers[k] for k in range(12)])
    assert cosine_rows(got, reference_embed(texts)).min() > 0.99999
    # uvicorn re-raises the signal once it has shut down: the process ends by SIGTERM, after the drain
    assert mini.proc.wait(timeout=60) in (0, -signal.SIGTERM)
    assert "Traceback" not in mini.output(tail=100_000)


# ------------------------------------------------------------------- every task kind, one model directory

@pytest.fixture(scope="module")
def models():
    return task_models_dir()


@pytest.fixture(scope="module")
def assistant(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("single-heads") / "assistant"
    d.mkdir()
    (d / "model.yaml").write_text(f"""source: {bundled_model_dir()}
engine: {{threads: 1, warmup_shapes: [[1, 8]]}}
heads:
  - {{name: intent, task: classify, source: {models / 'intent'}}}
  - {{name: slots, task: token-classify, source: {models / 'slots'}}}
  - {{name: ce, task: rerank, source: {models / 'ce'}}}
  - {{name: embed, task: embed}}
""")
    with ServerProcess(str(d), "--cache-bytes", "0", grpc=True) as srv:
        yield srv


def _answers(c: httpx.Client, query: str, docs: list[str]) -> dict:
    def post(path: str, body: dict):
        r = c.post(path, json=body)
        if r.status_code != 200:
            raise AssertionError(f"{path}: {r.status_code} {r.text[:200]}")
        return r.json()

    return {"intent": post("/predict", {"model": "intent", "inputs": query}),
            "slots": post("/models/slots", {"inputs": query, "parameters": {"aggregation_strategy": "simple"}}),
            "ce": post("/v1/rerank", {"model": "ce", "query": query, "documents": docs})["results"],
            "embed": post("/embed", {"model": "embed", "inputs": [query]})["embeddings"][0]}


def _same(got: dict, want: dict, tol: float = 1e-5) -> bool:
    """The same answer up to float noise (a batch of other sizes sums in another order)."""
    def rows(answer, key, *fields):
        return [tuple(x[f] for f in fields) for x in answer[key]]

    def scores(answer, key, field):
        return np.asarray([x[field] for x in answer[key]])

    return (rows(got, "intent", "label") == rows(want, "intent", "label")
            and np.allclose(scores(got, "intent", "score"), scores(want, "intent", "score"), atol=tol)
            and rows(got, "slots", "entity_group", "word", "start", "end")
            == rows(want, "slots", "entity_group", "word", "start", "end")
            and np.allclose(scores(got, "slots", "score"), scores(want, "slots", "score"), atol=tol)
            and rows(got, "ce", "index") == rows(want, "ce", "index")
            and np.allclose(scores(got, "ce", "relevance_score"), scores(want, "ce", "relevance_score"), atol=tol)
            and np.allclose(got["embed"], want["embed"], atol=tol))


def test_every_task_kind_in_single_model_mode(assistant, models, reference_embed):
    import transformers
    from sentence_transformers import CrossEncoder
    from transformers import pipeline

    transformers.logging.set_verbosity_error()
    query = "Turn on the lights in the kitchen at seven"
    docs = ["Lights can be switched on by voice.", "Timers ring when the countdown ends.", "Music plays loudly."]
    with httpx.Client(base_url=assistant.url, timeout=60) as c:
        got = _answers(c, query, docs)
        index = c.post("/v2/repository/index", json={}).json()
        # task results carry their stage timings into the KServe statistics, as embeddings do
        for head in ("intent", "slots", "ce"):
            st = c.get(f"/v2/models/{head}/stats").json()["model_stats"][0]["inference_stats"]
            for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
                assert st[stage]["count"] >= 1 and st[stage]["ns"] > 0, (head, stage, st)
    assert [(m["name"], m["state"]) for m in index] == [("assistant", "READY")]
    want = pipeline("text-classification", model=str(models / "intent"), device="cpu", top_k=None)(query)
    want = want[0] if isinstance(want[0], list) else want
    assert [g["label"] for g in got["intent"]] == [w["label"] for w in want]
    assert [g["score"] for g in got["intent"]] == pytest.approx([w["score"] for w in want], abs=1e-4)
    ents = pipeline("token-classification", model=str(models / "slots"), device="cpu",
                    aggregation_strategy="simple")(query)
    assert [(g["entity_group"], g["word"], g["start"], g["end"]) for g in got["slots"]] == \
        [(w["entity_group"], w["word"], w["start"], w["end"]) for w in ents]
    ref = np.asarray(CrossEncoder(str(models / "ce"), device="cpu").predict([(query, d) for d in docs]))
    assert [x["index"] for x in got["ce"]] == list(np.argsort(-ref))
    assert [x["relevance_score"] for x in got["ce"]] == pytest.approx(sorted(ref, reverse=True), abs=1e-5)
    assert cosine_rows(np.asarray([got["embed"]]), reference_embed([query])).min() > 0.99999


def test_reloads_under_traffic_drop_nothing_for_any_task(assistant):
    queries = ["play some jazz in the living room", "set a timer for ten minutes", "what is the weather in Oslo"]
    docs = ["Timers ring when the countdown ends.", "Weather forecasts cover ten days.", "Jazz plays on speakers."]
    with httpx.Client(base_url=assistant.url, timeout=60) as c:
        want = {q: _answers(c, q, docs) for q in queries}
    failures: list = []
    served = [0]
    stop = threading.Event()

    def client(k: int) -> None:
        with httpx.Client(base_url=assistant.url, timeout=60) as c:
            i = 0
            while not stop.is_set():
                q = queries[(k + i) % len(queries)]
                try:
                    got = _answers(c, q, docs)
                except Exception as exc:  # noqa: BLE001 - any failed request is a failure
                    failures.append((q, repr(exc)))
                    i += 1
                    continue
                if not _same(got, want[q]):
                    failures.append((q, got, want[q]))
                served[0] += 1
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    codes = []
    try:
        with httpx.Client(base_url=assistant.url, timeout=180) as c:
            time.sleep(0.3)
            for path in ("/models/assistant/reload", "/v2/repository/models/assistant/load"):
                codes.append(c.post(path).status_code)
                time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert codes == [200, 200]
    assert not failures, failures[:2]
    assert served[0] >= 8
    assert assistant.alive()

"""A decoder model on a real local Ray Serve instance: two replicas, each a whole
GenerateService, behind surge's HTTP app; answers equal a single `surge serve` process's.

0.5 CPU and one torch thread per replica so that it fits a 2-core CI machine.
"""

from __future__ import annotations

import asyncio
import os
import threading

import httpx
import pytest

pytest.importorskip("ray")
pytest.importorskip("ray.serve")
pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.decoder_models import build_model  # noqa: E402
from tests.server_process import ServerProcess, free_port  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP = "surge-generate-test"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Define assignment."}]
PROMPTS = ["The assignment", "If a specific method is not defined, the augmented", "Names", "A",
           "Assignment is defined recursively depending on the form of the target"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # a long context: a 1000-token stream outlasts reading its first chunks many times over
    return build_model("gpt2", tmp_path_factory.mktemp("raygen") / "tiny-gpt2", seed=3, n_positions=1024)


@pytest.fixture(scope="module")
def adapter_dir(model_dir):
    """A LoRA adapter every replica (and the single process) serves as model 'tune'."""
    pytest.importorskip("peft")
    from tests.decoder_models import build_lora

    return build_lora(model_dir, model_dir.parent / "tune", seed=4, r=4)


def _answers(base_url: str) -> dict:
    """Greedy chat and completions answers (the streamed ones concatenated) of one server."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="tiny-gpt2", messages=CHAT, max_tokens=24, temperature=0)
    out = {"chat": (chat.choices[0].message.content, chat.usage.completion_tokens, chat.choices[0].finish_reason)}
    for i, p in enumerate(PROMPTS):
        out[p] = client.completions.create(model="tiny-gpt2", prompt=p, max_tokens=10 + 2 * i,
                                           temperature=0).choices[0].text
    # structured outputs: the ingress checks the guide, a replica's sampler holds the answer to it
    for field, value in (("guided_choice", ["assignment", "target", "names"]), ("guided_regex", "[a-e]{3,6}")):
        out[field] = client.completions.create(model="tiny-gpt2", prompt="Names", max_tokens=12, temperature=0,
                                               extra_body={field: value}).choices[0].text
    # the Responses API (a conversation continued from the ingress' store) and Anthropic's Messages API
    first = client.responses.create(model="tiny-gpt2", input=CHAT[-1]["content"], max_output_tokens=8, temperature=0)
    then = client.responses.create(model="tiny-gpt2", input="And then?", previous_response_id=first.id,
                                   max_output_tokens=8, temperature=0)
    out["responses"] = (first.output_text, then.output_text, then.usage.input_tokens)
    import httpx

    msg = httpx.post(base_url + "/v1/messages", timeout=120, json={
        "model": "tiny-gpt2", "max_tokens": 8, "temperature": 0, "messages": [CHAT[-1]]}).json()
    out["messages"] = (msg["content"][0]["text"], msg["stop_reason"], msg["usage"]["output_tokens"])
    # a LoRA adapter, by its name: every replica loaded it; streamed through the ingress too
    out["lora"] = client.completions.create(model="tune", prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0].text
    out["lora_stream"] = "".join(c.choices[0].text for c in client.completions.create(
        model="tune", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True) if c.choices)
    out["models"] = sorted((m.id, getattr(m, "parent", None)) for m in client.models.list().data)
    return out


class _LocalAnswers(threading.Thread):
    """The answers of a single `surge serve` process, computed while Ray starts (their start-ups overlap)."""

    def __init__(self, model_dir, adapter_dir):
        super().__init__(daemon=True)
        self.model_dir, self.adapter_dir, self.answers, self.error = model_dir, adapter_dir, None, None
        self.start()

    def run(self):
        try:
            with ServerProcess(str(self.model_dir), "--threads", "1", "--lora-modules",
                               f"tune={self.adapter_dir}") as srv:
                self.answers = _answers(srv.url)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            self.error = exc

    def result(self) -> dict:
        self.join(300)
        if self.error is not None:
            raise self.error
        return self.answers


@pytest.fixture(scope="module")
def started_local(model_dir, adapter_dir):
    return _LocalAnswers(model_dir, adapter_dir)


@pytest.fixture(scope="module")
def local(cluster, started_local):
    return started_local.result()


@pytest.fixture(scope="module")
def cluster(model_dir, adapter_dir, started_local):
    import ray
    from ray import serve

    from surge.config import EngineConfig, GenerationConfig, ServerConfig
    from surge.distributed.config import RayDeploymentConfig
    from surge.distributed.ray_serve import deploy, plan_single

    config = ServerConfig(port=free_port(), grpc_port=None, model_dir=model_dir, engine=EngineConfig(threads=1),
                          generation=GenerationConfig(lora_modules={"tune": str(adapter_dir)}))
    ray_cfg = RayDeploymentConfig(num_replicas=2, num_cpus=0.5, health_check_period_s=2, health_check_timeout_s=20)

    def no_export(*_):
        raise AssertionError("a decoder model is not exported")

    targets = plan_single(config, ray_cfg, resolve=no_export)
    assert [t.spec.task for t in targets] == ["generate"]
    period = os.environ.get("SURGE_RAY_METRICS_PERIOD_S")
    os.environ["SURGE_RAY_METRICS_PERIOD_S"] = "0.5"
    try:
        deploy(targets, config, app_name=APP, num_cpus=2, namespace="surge-generate-tests")
        yield f"http://127.0.0.1:{config.port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        if period is None:
            os.environ.pop("SURGE_RAY_METRICS_PERIOD_S", None)
        else:
            os.environ["SURGE_RAY_METRICS_PERIOD_S"] = period


def test_ray_replicas_answer_as_a_single_process_does(cluster, local):
    assert _answers(cluster) == local
    assert local["guided_choice"] in ("assignment", "target", "names")
    assert local["lora"] == local["lora_stream"] and local["lora"] != local[PROMPTS[1]]
    assert ("tune", "tiny-gpt2") in local["models"]
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0)
    # A stream through the ingress: its concatenation is the non-streamed answer, usage last.
    chunks = list(client.chat.completions.create(model="tiny-gpt2", messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (text, chunks[-1].usage.completion_tokens) == local["chat"][:2]

    async def collect():  # concurrent streams, joining the replicas' running batches
        aclient = openai.AsyncOpenAI(base_url=cluster + "/v1", api_key="unused", max_retries=0)

        async def one(i, p):
            s = await aclient.completions.create(model="tiny-gpt2", prompt=p, max_tokens=10 + 2 * i, temperature=0,
                                                 stream=True)
            return "".join([c.choices[0].text async for c in s if c.choices])

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        finally:
            await aclient.close()

    assert asyncio.run(collect()) == [local[p] for p in PROMPTS]


def test_both_replicas_serve_and_protocol_errors_cross_the_ingress(cluster, local):
    from concurrent.futures import ThreadPoolExecutor

    replicas = set()
    with httpx.Client(base_url=cluster, timeout=60, limits=httpx.Limits(max_connections=8)) as http:
        def one(i: int) -> httpx.Response:
            # seeded sampling with a fresh seed: never a cache hit, computed by whichever replica Ray picks
            return http.post("/v1/completions", json={"prompt": "Names", "max_tokens": 3, "seed": 1000 + i})

        # Eight at a time: Ray routes each request to the less busy of two replicas it samples,
        # so sequential requests on an idle cluster may all land on one; concurrent ones spread.
        with ThreadPoolExecutor(8) as pool:
            for start in range(0, 64, 8):
                for r in pool.map(one, range(start, start + 8)):
                    assert r.status_code == 200, r.text
                    replicas.add(r.headers["x-surge-replica"])
                if len(replicas) == 2:
                    break
        assert len(replicas) == 2, replicas
        # the KServe generate extension
        r = http.post("/v2/models/tiny-gpt2/generate",
                      json={"text_input": "Names", "parameters": {"max_tokens": 12, "temperature": 0}})
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == local["Names"][:len(r.json()["text_output"])]
        assert http.get("/v2/models/tiny-gpt2").json()["inputs"][0]["name"] == "text_input"
        assert http.get("/v2/models/tiny-gpt2/config").json()["input"][0]["name"] == "text_input"
        # bad input: the ingress's own checks and a replica's errors keep their statuses
        long_prompt = " ".join(["assignment target"] * 400)
        r = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4})
        assert r.status_code == 400 and "context is" in r.json()["error"]["message"], r.text
        r = http.post("/v1/embeddings", json={"input": "x", "model": "tiny-gpt2"})
        assert r.status_code == 400 and "serves task 'generate'" in r.json()["error"]["message"], r.text
        r = http.post("/v1/completions", json={"prompt": "Names", "max_tokens": 4, "top_p": 0})
        assert r.status_code in (400, 422), r.text
        r = http.post("/v1/completions", json={"prompt": "Names", "max_tokens": 4, "guided_regex": "a(b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny-gpt2", "tune"]


def _metric(base_url: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=30).text):
        for smp in fam.samples:
            if smp.name == name and all(smp.labels.get(k) == v for k, v in labels.items()):
                total += smp.value
    return total


def test_a_stream_whose_client_leaves_is_aborted_on_its_replica(cluster):
    import time

    aborted = _metric(cluster, "surge_generate_requests_total", finish_reason="abort")
    body = {"prompt": "Names", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True, "seed": 5}
    with httpx.stream("POST", cluster + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
    assert any(line.startswith("data: ") for line in got)
    deadline = time.monotonic() + 30  # replicas push their metrics every 0.5 s
    while time.monotonic() < deadline:
        if _metric(cluster, "surge_generate_requests_total", finish_reason="abort") > aborted \
                and _metric(cluster, "surge_generate_running_sequences") == 0:
            break
        time.sleep(0.2)
    assert _metric(cluster, "surge_generate_requests_total", finish_reason="abort") == aborted + 1
    assert _metric(cluster, "surge_generate_requests_total", finish_reason="length") >= 1
    assert _metric(cluster, "surge_generate_running_sequences") == 0

"""`surge serve DECODER --workers 2`: real processes (supervisor, two front ends, one engine process
running the decoder's shared engine loop), called with the real openai client.

- concurrent chats and completions, streamed and not, spread over both front ends: transformers'
  greedy text each;
- /metrics whole: output tokens summed over the front ends, the engine-wide gauges one series;
- a killed engine process ends the streams in flight at once with an error event, the model answers
  503 until the supervisor's new engine process serves (transformers' text again), one restart counted;
- SIGTERM lets a stream in flight finish, then everything exits;
- the Responses API's stored answers are every process's: a conversation continued over fresh
  connections (any front end, or the engine process serving a handed-over one) reads the response
  another process stored, and a background response is cancelled from wherever the cancel lands.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import psutil
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.decoder_models import build_model, load_hf  # noqa: E402
from tests.e2e.test_generate_server import hf_text, metric  # noqa: E402
from tests.server_process import ServerProcess, children_by_role, wait_ready  # noqa: E402

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The augmented assignment statement", "Define assignment.", "Loops repeat", "What is a variable?",
           "a b c d e f g", "Python"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("wgen") / "chat-qwen", seed=4, hidden_size=128)


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_hf(model_dir)


@pytest.fixture(scope="module")
def tune(model_dir, hf):
    """A LoRA adapter the server serves as model 'tune' (every front end loads it into the shared engine's
    same slot) and transformers + peft with it: (directory, (model, tokenizer))."""
    pytest.importorskip("peft")
    from tests.decoder_models import build_lora, load_peft

    d = build_lora(model_dir, model_dir.parent / "tune", seed=5, r=4)
    return d, (load_peft(model_dir, d), hf[1])


@pytest.fixture(scope="module")
def server(model_dir, tune):
    with ServerProcess(str(model_dir), "--workers", "2", "--threads", "1", "--generation",
                       "cache_entries=0,allow_runtime_lora=true", "--lora-modules", f"tune={tune[0]}") as srv:
        yield srv


def _tuned(server, i: int) -> str:
    """A fresh connection's greedy completion of PROMPTS[i] by adapter 'tune' (connections spread over
    the front ends)."""
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "tune", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_concurrent_answers_equal_transformers(server, hf, tune):
    roles = children_by_role(server)
    assert len(roles["front"]) == 2 and len(roles["engine"]) == 1
    _, tok = hf

    async def main():
        # a client per request: new connections, which the kernel spreads over both front ends
        async def chat(i):
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
                messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
                parts = []
                async for ch in await c.chat.completions.create(model="chat-qwen", messages=messages,
                                                                max_tokens=10 + i, temperature=0, stream=True):
                    parts.extend(x.delta.content or "" for x in ch.choices)
                return "".join(parts)

        async def completion(i):
            async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
                r = await c.completions.create(model="chat-qwen", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=6 + i,
                                               temperature=0)
                return r.choices[0].text, r.usage.completion_tokens

        return await asyncio.gather(*(chat(i) for i in range(8))), await asyncio.gather(
            *(completion(i) for i in range(8)))

    before = metric(server, "surge_generate_output_tokens_total")
    chats, completions = asyncio.run(main())
    n_out = 0
    for i, text in enumerate(chats):
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        expected, n = hf_text(hf, ids, 10 + i)
        assert text == expected, i
        n_out += n
    for i, (text, n) in enumerate(completions):
        expected, m = hf_text(hf, tok(PROMPTS[i % len(PROMPTS)])["input_ids"], 6 + i)
        assert text == expected and n == m, i
        n_out += n
    # /metrics whole across the front ends; the engine's gauges one series (the engine process's)
    assert metric(server, "surge_generate_output_tokens_total") - before == n_out
    text = httpx.get(server.url + "/metrics", timeout=30).text
    running = [line for line in text.splitlines() if line.startswith("surge_generate_running_sequences{")]
    assert len(running) == 1 and running[0].endswith(" 0.0"), running
    assert sum(1 for line in text.splitlines() if line.startswith("surge_generate_kv_cache_usage_ratio{")) == 1
    # loading while serving would give the shared engine's slot two adapters: refused
    r = httpx.post(server.url + "/v1/load_lora_adapter", timeout=30, json={"lora_name": "x", "lora_path": str(tune[0])})
    assert r.status_code == 501 and "not this server's alone" in r.json()["error"]["message"], r.text
    # the adapter from either front end: peft's answer, not the base model's
    for i in range(4):
        ids = tok(PROMPTS[i % len(PROMPTS)])["input_ids"]
        assert _tuned(server, i) == hf_text(tune[1], ids, 8)[0] != hf_text(hf, ids, 8)[0], i


def test_stored_responses_are_shared_by_every_process(server, hf):
    import glob

    model, tok = hf

    def fresh():  # a new client, a new connection: the kernel picks the process
        return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)

    turns, prev = [], None
    for k, ask in enumerate(PROMPTS[:4]):
        r = fresh().responses.create(model="chat-qwen", input=ask, previous_response_id=prev, max_output_tokens=6,
                                     temperature=0)
        turns += [{"role": "user", "content": ask}]
        ids = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert r.output_text == hf_text(hf, list(ids), 6)[0], k
        turns += [{"role": "assistant", "content": r.output_text}]
        assert glob.glob(f"/dev/shm/surge-cache-*/responses/{r.id}.json") or \
            glob.glob(f"/tmp/surge-cache-*/responses/{r.id}.json")  # the shared store, not a process's own
        prev = r.id
        assert all(fresh().responses.retrieve(r.id).output_text == r.output_text for _ in range(3))
    for _ in range(5):  # the tiny model can make its 200 tokens before the cancel lands: it then ends as it ended
        long = fresh().responses.create(model="chat-qwen", input="x", max_output_tokens=200, temperature=0,
                                        background=True, extra_body={"ignore_eos": True})
        cancel = fresh().responses.cancel(long.id)
        if cancel.status == "cancelled":
            break
        assert (cancel.status, cancel.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert cancel.status == "cancelled"
    deadline = time.monotonic() + 30
    while fresh().responses.retrieve(long.id).status != "cancelled" and time.monotonic() < deadline:
        time.sleep(0.1)  # a cancel from another process lands when the runner's next tokens arrive
    assert fresh().responses.retrieve(long.id).status == "cancelled"


def test_engine_crash_ends_streams_at_once_and_recovers(server, hf, tune):
    _, tok = hf
    engine = children_by_role(server)["engine"][0]
    restarts = metric(server, "surge_generate_engine_restarts_total")
    body = {"model": "chat-qwen", "prompt": "Names", "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))  # streaming
        engine.kill()
        t0 = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - t0 < 30  # at once, not at the request's deadline
    assert any('"error"' in line for line in rest), rest[-3:]
    r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
    assert r.status_code in (200, 503)  # 503 until the new engine process serves
    wait_ready(server)
    new = children_by_role(server)["engine"]
    assert len(new) == 1 and new[0].pid != engine.pid
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "chat-qwen", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == hf_text(hf, tok(PROMPTS[0])["input_ids"], 12)[0]
    assert metric(server, "surge_generate_engine_restarts_total") == restarts + 1
    # the new engine process's LoRA slots were filled again by the front ends
    for i in range(2):
        assert _tuned(server, i) == hf_text(tune[1], tok(PROMPTS[i])["input_ids"], 8)[0], i


def test_sigterm_lets_a_stream_finish_then_exits(server):
    procs = children_by_role(server)["front"] + children_by_role(server)["engine"]
    body = {"model": "chat-qwen", "prompt": "Names", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    assert server.proc.wait(timeout=60) == 0
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive


def test_repository_decoder_zero_downtime_reload_across_processes(tmp_path, model_dir, hf):
    """`--model-repository` under `--workers 2` with a decoder and an embedding model: both served by both
    front ends; a reload while a stream runs on version 1 finishes that stream whole on version 1, version 2
    answers from then on, and version 1's build goes once the front ends left it; a killed engine process takes
    its decoder build's process with it and the restarted one serves the model again."""
    import glob
    import os
    import shutil

    from tests.e2e.repo_helpers import add_version

    _, tok = hf
    root = tmp_path / "repo"
    (root / "chat" / "1").mkdir(parents=True)
    (root / "chat" / "1" / "model.yaml").write_text(f"source: {model_dir}\nengine:\n  threads: 1\n"
                                                    "generation:\n  cache_entries: 0\n")
    add_version(root, "enc", 1)
    with ServerProcess("--model-repository", str(root), "--workers", "2") as srv:
        sock_dir = os.path.dirname(children_by_role(srv)["engine"][0].cmdline()[-1])
        assert len(glob.glob(os.path.join(sock_dir, "gen-*.sock"))) == 1
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model="chat", prompt=PROMPTS[0], max_tokens=150, temperature=0, extra_body={"ignore_eos": True})
        reference = client.completions.create(**kw).choices[0].text
        model, _ = hf
        ids = tok(PROMPTS[0])["input_ids"]
        out = model.generate(torch.tensor([ids]), max_new_tokens=150, min_new_tokens=150, do_sample=False,
                             pad_token_id=0)[0, len(ids):]
        assert reference == tok.decode(out, skip_special_tokens=True)
        r = httpx.post(srv.url + "/v1/embeddings", json={"model": "enc", "input": "an embedding"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        stream = client.completions.create(**kw, stream=True)
        first = next(iter(stream))  # a stream in flight on version 1
        shutil.copytree(root / "chat" / "1", root / "chat" / "2")
        r = httpx.post(srv.url + "/models/chat/reload", timeout=120)
        assert r.status_code == 200, r.text
        rest = "".join(c.choices[0].text for c in stream if c.choices)
        assert first.choices[0].text + rest == reference  # finished on version 1, whole
        for _ in range(4):  # new connections: both front ends answer from version 2
            after = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                "model": "chat", "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0, "ignore_eos": True})
            assert after.status_code == 200 and after.headers["x-surge-model-version"] == "2", after.text
        deadline = time.monotonic() + 60
        while len(glob.glob(os.path.join(sock_dir, "gen-*.sock"))) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(glob.glob(os.path.join(sock_dir, "gen-*.sock"))) == 1  # version 1's build is gone
        # the engine process killed: its decoder build's process sees it gone and exits; the supervisor's new
        # engine process builds the repository again and both front ends serve it
        engine = children_by_role(srv)["engine"][0]
        builds = [p for p in engine.children() if "surge.cli.workers_generate" in " ".join(p.cmdline())]
        assert len(builds) == 1
        engine.kill()
        _, alive = psutil.wait_procs(builds, timeout=30)
        assert not alive
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                again = httpx.post(srv.url + "/v1/completions", timeout=60, json={
                    "model": "chat", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
                if again.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == reference[:len(
            again.json()["choices"][0]["text"])], again.text
        r = httpx.post(srv.url + "/models/chat/unload", timeout=60)
        assert r.status_code == 200, r.text
        gone = httpx.post(srv.url + "/v1/completions", timeout=60, json={"model": "chat", "prompt": "x",
                                                                          "max_tokens": 2})
        assert gone.status_code == 404, gone.text

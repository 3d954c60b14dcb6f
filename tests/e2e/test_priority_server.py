"""Priority scheduling end to end (vLLM's `--scheduling-policy priority` and request `priority`): a real
`surge serve` process with `--generation scheduling_policy=priority,max_num_seqs=1`, its engine loop in a
process of its own, called with the async openai client. Requests queued behind a running one are served by
priority (lower first), then arrival; every answer is still transformers' greedy one. A server under the
default policy refuses a priority other than 0 (400), on the OpenAI and KServe routes."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.decoder_models import build_model, load_hf  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

NAME = "prio-qwen"
QUESTIONS = ["Define assignment.", "Name a colour.", "Count to three.", "Say hello."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("qwen2", tmp_path_factory.mktemp("prio") / NAME, seed=8, max_position_embeddings=4096)


def _waiting(text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("surge_generate_waiting_sequences{"))


async def _until_waiting(url: str, n: int) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        end = time.monotonic() + 120
        while _waiting((await http.get("/metrics")).text) < n:
            assert time.monotonic() < end, f"{n} requests never waited"
            await asyncio.sleep(0.05)


def test_queued_requests_run_by_priority(model_dir):
    model, tok = load_hf(model_dir)
    refs = {}
    for q in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        refs[q] = tok.decode(out[0, len(ids):], skip_special_tokens=True)

    async def scenario(url):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
        # the one sequence the engine runs at a time, long enough to outlast the queueing below; it is then
        # closed (the client leaves: its blocks are freed at once) and the queue runs
        blocker = await client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "Talk."}], max_tokens=3500, temperature=0,
            stream=True, extra_body={"ignore_eos": True, "priority": 10})
        await blocker.__aiter__().__anext__()
        order = []

        async def one(q, priority):
            r = await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": q}],
                                                     max_tokens=12, temperature=0, extra_body={"priority": priority})
            order.append(q)
            return r.choices[0].message.content

        low = []
        for q in QUESTIONS[:3]:  # priority 5, one after another (arrival order among equals)
            low.append(asyncio.create_task(one(q, 5)))
            await _until_waiting(url, len(low))
        high = asyncio.create_task(one(QUESTIONS[3], -1))  # last to arrive, first to run
        await _until_waiting(url, 4)
        await blocker.close()
        texts = await asyncio.gather(*low, high)
        return order, texts

    with ServerProcess(str(model_dir), "--threads", "1", "--generation",
                       "scheduling_policy=priority,max_num_seqs=1,cache_entries=0,engine_process=true") as srv:
        order, texts = asyncio.run(scenario(srv.url))
        # the Responses API and KServe's generate take the priority too
        sync = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        assert sync.responses.create(model=NAME, input="hi", max_output_tokens=2, extra_body={"priority": 2}).output_text
        r = httpx.post(srv.url + f"/v2/models/{NAME}/generate", timeout=60,
                       json={"text_input": "hi", "parameters": {"max_tokens": 2, "priority": 3}})
        assert r.status_code == 200, r.text
    assert order == [QUESTIONS[3]] + QUESTIONS[:3]
    assert texts == [refs[q] for q in QUESTIONS]


def test_a_priority_needs_the_priority_policy(model_dir):
    with ServerProcess(str(model_dir), "--threads", "1") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
        messages = [{"role": "user", "content": "Say hello."}]
        with pytest.raises(openai.BadRequestError, match="scheduling_policy"):
            client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, extra_body={"priority": 1})
        with pytest.raises(openai.BadRequestError, match="scheduling_policy"):
            client.completions.create(model=NAME, prompt="hi", max_tokens=2, extra_body={"priority": -2})
        with pytest.raises(openai.BadRequestError, match="scheduling_policy"):
            client.responses.create(model=NAME, input="hi", max_output_tokens=2, extra_body={"priority": 4})
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, extra_body={"priority": 0})
        assert r.choices[0].finish_reason == "length"
        r = httpx.post(srv.url + f"/v2/models/{NAME}/generate", timeout=60,
                       json={"text_input": "hi", "parameters": {"max_tokens": 2, "priority": 3}})
        assert r.status_code == 400 and "scheduling_policy" in r.text, r.text

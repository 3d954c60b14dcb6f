"""LoRA adapters end to end: a real `surge serve BASE --lora-modules wide=DIR` (its engine loop in a
process of its own, so adapters and their sequences cross the process boundary; one engine slot, so
adapters are swapped through it), called with the real openai client. Every answer equals transformers + peft's greedy answer with that adapter (or none),
whole and streamed, whichever requests share a batch; the generation and prefix caches keep
adapters apart; vLLM's routes load and unload a second adapter while serving."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("peft")

from tests.decoder_models import build_lora, build_model, load_hf, load_peft  # noqa: E402
from tests.server_process import ServerProcess, fresh_client  # noqa: E402

ASK = [{"role": "user", "content": "What is the capital of France?"}]
N = 10


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loraserve")
    base = build_model("qwen2", root / "base-qwen", seed=3)
    return {"base": base, "wide": build_lora(base, root / "wide", seed=1, r=8),
            "narrow": build_lora(base, root / "narrow", seed=2, r=4, targets=["q_proj", "v_proj", "down_proj"],
                                 scale=10),
            "third": build_lora(base, root / "third", seed=3, r=2)}


@pytest.fixture(scope="module")
def refs(dirs):
    """transformers (+ peft) greedy text of ASK for the base model and each adapter."""
    hf, tok = load_hf(dirs["base"])
    ids = tok.apply_chat_template(ASK, add_generation_prompt=True, return_dict=False)
    out = {}
    for name in ("base", "wide", "narrow"):
        model = hf if name == "base" else load_peft(dirs["base"], dirs[name])
        got = model.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):]
        out[name] = tok.decode(got, skip_special_tokens=True)
    assert len(set(out.values())) == 3, "each adapter must change the answer"
    return out


@pytest.fixture(scope="module")
def server(dirs):
    with ServerProcess(str(dirs["base"]), "--threads", "1", "--lora-modules", f"wide={dirs['wide']}",
                       "--generation", "max_loras=1,max_cpu_loras=2,allow_runtime_lora=true,engine_process=true") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client, model, **kw):
    return client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=N,
                                          extra_body={"ignore_eos": True}, **kw)


def test_models_list_the_adapter_with_its_parent(client, dirs):
    models = {m.id: m for m in client.models.list().data}
    assert models["wide"].parent == "base-qwen" and models["wide"].root == str(dirs["wide"].resolve())
    assert getattr(models["base-qwen"], "parent", None) is None


def test_adapter_answers_equal_peft_whole_streamed_and_batched(server, client, refs):
    import asyncio

    # base first, then the adapter: a generation cache or prefix cache that mixed them would answer wrongly
    assert _chat(client, "base-qwen").choices[0].message.content == refs["base"]
    assert _chat(client, "wide").choices[0].message.content == refs["wide"]
    assert _chat(client, "base-qwen").choices[0].message.content == refs["base"]
    chunks = list(_chat(client, "wide", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == refs["wide"]
    assert {c.model for c in chunks} == {"wide"}

    async def together():  # base and adapter rows in the same steps (sampled: not from the cache)
        aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0)
        jobs = [aclient.chat.completions.create(model=m, messages=ASK, temperature=0, max_tokens=N, seed=i,
                                                extra_body={"ignore_eos": True})
                for i, m in enumerate(["wide", "base-qwen"] * 4)]
        return [r.choices[0].message.content for r in await asyncio.gather(*jobs)]

    assert asyncio.run(together()) == [refs["wide"], refs["base"]] * 4
    metrics = fresh_client(server.url).get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("surge_generate_lora_requests_total{")
                and 'adapter="wide"' in x)
    assert 'model="base-qwen"' in line and float(line.rsplit(" ", 1)[1]) == 6.0  # 2 whole + 4 batched


def test_completions_with_an_adapter(client, dirs, refs):
    _, tok = load_hf(dirs["base"])
    prompt = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    r = client.completions.create(model="wide", prompt=prompt, temperature=0, max_tokens=N,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == refs["wide"] and r.model == "wide"
    # the Responses API by the adapter's name (the same conversation: one user turn)
    resp = client.responses.create(model="wide", input=ASK[0]["content"], max_output_tokens=N, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert resp.output_text == refs["wide"] and resp.model == "wide"
    # KServe's generate extension by the adapter's name
    kserve = fresh_client(str(client.base_url).removesuffix("/").removesuffix("/v1"), timeout=60).post(
        "/v2/models/wide/generate", json={"text_input": prompt, "parameters": {
            "temperature": 0, "max_tokens": N, "ignore_eos": True}})
    assert kserve.status_code == 200 and kserve.json()["text_output"] == refs["wide"], kserve.text
    meta = fresh_client(str(client.base_url).removesuffix("/").removesuffix("/v1"), timeout=60).get("/v2/models/wide")
    assert meta.status_code == 200 and meta.json()["name"] == "wide", meta.text


def test_load_and_unload_while_serving(server, client, dirs, refs):
    http = fresh_client(server.url, timeout=60)
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "narrow", "lora_path": str(dirs["narrow"])})
    assert r.status_code == 200 and "narrow" in r.text, r.text
    assert _chat(client, "narrow").choices[0].message.content == refs["narrow"]
    assert _chat(client, "wide").choices[0].message.content == refs["wide"]
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "narrow", "lora_path": str(dirs["narrow"])})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    full = http.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(dirs["third"])})
    assert full.status_code == 400 and "max_cpu_loras" in full.json()["error"]["message"]

    async def mixed():  # two adapters on the engine's one slot, and the base model, at once
        aclient = openai.AsyncOpenAI(base_url=str(client.base_url), api_key="unused", max_retries=0)
        jobs = [aclient.chat.completions.create(model=m, messages=ASK, temperature=0, max_tokens=N, seed=i,
                                                extra_body={"ignore_eos": True})
                for i, m in enumerate(["narrow", "wide", "base-qwen"] * 3)]
        return [r.choices[0].message.content for r in await asyncio.gather(*jobs)]

    import asyncio

    assert asyncio.run(mixed()) == [refs["narrow"], refs["wide"], refs["base"]] * 3
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(dirs["base"] / "nope")})
    assert missing.status_code == 400 and "adapter_config.json" in missing.json()["error"]["message"]

    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "narrow"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _chat(client, "narrow")
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "narrow"}).status_code == 404
    # room again: the third adapter loads, and the first one still answers as before
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(dirs["third"])}) \
        .status_code == 200
    assert _chat(client, "wide").choices[0].message.content == refs["wide"]
    assert "third" in {m.id for m in client.models.list().data}


def test_runtime_loading_alone_gives_a_slot(dirs, refs):
    """README: `--generation allow_runtime_lora=true` is all that loading adapters while serving needs
    (vLLM's --enable-lora gives one slot by default); with no --lora-modules the engine still needs a
    slot, and the one decoder is the base a request without `model` names."""
    with ServerProcess(str(dirs["base"]), "--threads", "1", "--generation", "allow_runtime_lora=true") as srv:
        http = fresh_client(srv.url, timeout=60)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "narrow", "lora_path": str(dirs["narrow"])})
        assert r.status_code == 200 and "narrow" in r.text, r.text
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        assert _chat(client, "narrow").choices[0].message.content == refs["narrow"]
        assert _chat(client, "base-qwen").choices[0].message.content == refs["base"]

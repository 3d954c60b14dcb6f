"""A decoder model's versions end to end: a real `surge serve` process, the real openai client (each test failed
before its fix, session 41).

- A stream of a LoRA adapter (a view of its base model) in flight when the base model is unloaded or
  reloaded finishes whole, as the base model's own streams do (drained, not cut).
- A LoRA adapter loaded at run time is still served after its base model is reloaded, by the new build:
  no view of the retired build is left behind (the server stays ready, no request reaches a closed engine).
- The shared (Redis) tier of the generation cache never answers a version reloaded with other weights with
  the answers of the weights it had.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
pytest.importorskip("peft")
redis = pytest.importorskip("redis")

from tests.decoder_models import build_lora, build_model, load_hf  # noqa: E402
from tests.server_process import ServerProcess, fresh_client  # noqa: E402

LONG = 1900  # tokens: a stream that outlasts an unload's drain grace many times over


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("genversions")
    # wide enough that a LONG-token stream outlasts a reload (a new engine process built and warmed up)
    base = build_model("qwen2", root / "base-qwen", seed=3, max_position_embeddings=2048, hidden_size=256,
                       intermediate_size=512, num_hidden_layers=4)
    return {"base": base, "wide": build_lora(base, root / "wide", seed=1, r=8),
            "third": build_lora(base, root / "third", seed=3, r=2)}


def _lora_server(dirs):
    return ServerProcess(str(dirs["base"]), "--threads", "1", "--lora-modules", f"wide={dirs['wide']}",
                         "--generation", "max_loras=1,max_cpu_loras=2,allow_runtime_lora=true")


def _long_stream(base_url: str, model: str, out: dict) -> None:
    """A long greedy completion streamed over SSE: its text pieces, finish reason and any error."""
    body = {"model": model, "prompt": "The target", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": True, "seed": 5}
    out["events"] = []
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out["events"].append(line[6:])
                    out.setdefault("first", time.monotonic())
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)


def _outcome(out: dict) -> tuple[str | None, int, list]:
    import json

    finish, n, errors = None, 0, []
    for e in out["events"]:
        obj = json.loads(e)
        if "error" in obj:
            errors.append(obj["error"])
            continue
        for c in obj.get("choices", []):
            if c.get("text"):
                n += 1
            if c.get("finish_reason"):
                finish = c["finish_reason"]
    return finish, n, errors


@pytest.mark.parametrize("how", ["unload", "reload"])
def test_an_adapter_stream_in_flight_is_drained_not_cut(dirs, how):
    """An adapter's stream in flight when its base model is unloaded (reloaded) finishes whole
    (finish_reason "length", no error event), as the base model's own streams do: the retired build is
    drained of its adapters' streams too before its engine is closed."""
    with _lora_server(dirs) as srv:
        outs = {"wide": {}}
        threads = [threading.Thread(target=_long_stream, args=(srv.url, m, outs[m])) for m in outs]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while not all("first" in o for o in outs.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all("first" in o for o in outs.values()), outs
        r = fresh_client(srv.url, timeout=120).post(f"/models/base-qwen/{how}")
        assert r.status_code == 200, r.text
        for t in threads:
            t.join(120)
        for model, out in outs.items():
            finish, _, errors = _outcome(out)
            assert out.get("status") == 200 and "error" not in out, (model, out.get("error"))
            assert not errors and finish == "length", (model, errors, finish)


def test_a_runtime_adapter_leaves_no_view_of_the_retired_build(dirs):
    """An adapter loaded at run time, then its base model reloaded: the server stays ready, and the
    adapter answers as before, from the new build (never "not ready" from the retired engine)."""
    with _lora_server(dirs) as srv:
        http = fresh_client(srv.url, timeout=120)
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(dirs["third"])})
        assert r.status_code == 200, r.text
        body = {"model": "third", "prompt": "The target", "max_tokens": 4, "temperature": 0}
        before = http.post("/v1/completions", json=body)
        assert before.status_code == 200, before.text
        assert http.post("/models/base-qwen/reload").status_code == 200
        assert http.get("/ready").status_code == 200, http.get("/ready").text
        after = http.post("/v1/completions", json=body)
        assert after.status_code == 200, (after.status_code, after.text)
        assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
        # the configured adapter answers from the new build
        assert http.post("/v1/completions", json={**body, "model": "wide"}).status_code == 200


def test_the_shared_tier_never_answers_a_version_reloaded_with_other_weights(tmp_path, dirs, redis_server):
    """Version 1 of a repository model, served with `--redis-url`: a greedy answer, then model.yaml points
    version 1 at other weights (same tokenizer, same settings) and the model is reloaded. The same request
    must be answered by the new weights, as transformers computes them, not by the shared tier's entry
    that the old weights wrote."""
    other = build_model("qwen2", tmp_path / "other-qwen", seed=11, max_position_embeddings=2048, hidden_size=256,
                        intermediate_size=512, num_hidden_layers=4)
    (root := tmp_path / "repo" / "chat" / "1").mkdir(parents=True)
    yaml = root / "model.yaml"
    yaml.write_text(f"source: {dirs['base']}\nengine:\n  threads: 1\n")
    prompt = "The target"
    refs = {}
    for key, d in (("base", dirs["base"]), ("other", other)):
        model, tok = load_hf(d)
        ids = tok(prompt)["input_ids"]
        got = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):]
        refs[key] = tok.decode(got, skip_special_tokens=True)
    assert refs["base"] != refs["other"]
    with ServerProcess("--model-repository", str(tmp_path / "repo"), "--redis-url", redis_server) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="chat", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        store = redis.Redis.from_url(redis_server)
        before = set(store.keys("surge:chat:1:*"))
        assert client.completions.create(**kw).choices[0].text == refs["base"]
        # the shared tier's write is in the background: the old weights' entry is there before the reload
        deadline = time.monotonic() + 60
        while not set(store.keys("surge:chat:1:*")) - before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(store.keys("surge:chat:1:*")) - before, "the old weights' answer never reached the shared tier"
        yaml.write_text(f"source: {other}\nengine:\n  threads: 1\n")
        r = fresh_client(srv.url, timeout=120).post("/models/chat/reload")
        assert r.status_code == 200, r.text
        got = client.completions.create(**kw).choices[0].text
        assert got == refs["other"], f"answered {got!r}; the old weights' answer was {refs['base']!r}"

"""Generation settings from model.yaml's `generation:` section and the server-wide `--generation` flag
(SURGE_GENERATION_<FIELD>), end to end in a real `surge serve --model-repository` process."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

pytest.importorskip("torch")

from tests.decoder_models import build_model  # noqa: E402
from tests.server_process import ROOT, ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model("gpt2", tmp_path_factory.mktemp("gen-settings") / "tiny-gpt2", seed=7)


def test_model_yaml_generation_section_overrides_the_servers_settings(tmp_path, model_dir):
    root = tmp_path / "repo"
    for name, extra in (("short", "generation:\n  default_max_tokens: 3\n"), ("plain", "")):
        (root / name / "1").mkdir(parents=True)
        (root / name / "1" / "model.yaml").write_text(f"source: {model_dir}\nengine:\n  threads: 1\n{extra}")
    # Server-wide: default_max_tokens 7 and an 80-token context (the flag); cache off (the environment).
    with ServerProcess("--model-repository", str(root), "--generation", "default_max_tokens=7,max_model_len=80",
                       env={"SURGE_GENERATION_CACHE_ENTRIES": "0"}, grpc=True) as srv:
        def complete(model, prompt="The assignment", **kw):
            return httpx.post(srv.url + "/v1/completions", timeout=60,
                              json={"model": model, "prompt": prompt, "temperature": 0, "ignore_eos": True, **kw})

        def chat(model, **kw):  # chat has no max_tokens default of its own (completions: OpenAI's 16)
            return httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
                "model": model, "messages": [{"role": "user", "content": "Define assignment."}], "temperature": 0,
                "ignore_eos": True, **kw})

        r = chat("short")  # no max_tokens: the model.yaml's default
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3 and r.json()["choices"][0]["finish_reason"] == "length"
        r = chat("plain")  # no section: the server's default
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 7
        assert chat("short", max_tokens=2).json()["usage"]["completion_tokens"] == 2  # a request's own wins
        long_prompt = " ".join(["assignment target"] * 60)
        for model in ("short", "plain"):  # the fields a section does not set stay the server's: 80 tokens
            r = complete(model, prompt=long_prompt)
            assert r.status_code == 400 and "context is 80 tokens" in r.text, r.text
        # Triton's model configuration of a decoder model (tritonclient's get_model_config reads it)
        cfg = httpx.get(srv.url + "/v2/models/plain/config")
        assert cfg.status_code == 200, cfg.text
        assert [t["name"] for t in cfg.json()["input"]] == ["text_input"]
        assert cfg.json()["parameters"]["task"] == {"string_value": "generate"}
        import tritonclient.grpc as tgrpc

        g = tgrpc.InferenceServerClient(srv.grpc_url)
        proto = g.get_model_config("plain").config
        assert proto.input[0].name == "text_input" and proto.parameters["task"].string_value == "generate"
        g.close()
        # cache_entries 0 from the environment: a repeated greedy request is computed again
        complete("plain", max_tokens=4)
        complete("plain", max_tokens=4)
        metrics = httpx.get(srv.url + "/metrics").text
        assert not any(line.startswith("surge_generate_cache_hits_total") and float(line.rsplit(" ", 1)[1]) > 0
                       for line in metrics.splitlines())


def test_unknown_or_invalid_generation_settings_are_clear_errors(tmp_path, model_dir):
    bad = subprocess.run([sys.executable, "-m", "surge.cli.main", "serve", "--generation", "kv_blocks=4"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2 and "kv_blocks" in bad.stderr and "kv_cache_tokens" in bad.stderr
    root = tmp_path / "repo"
    (root / "m" / "1").mkdir(parents=True)
    (root / "m" / "1" / "model.yaml").write_text(f"source: {model_dir}\ngeneration:\n  max_num_seqs: 0\n")
    srv = ServerProcess("--model-repository", str(root))
    srv.ready_path = "/v2/health/live"  # nothing loads, so /ready stays 503
    with srv:
        listing = httpx.get(srv.url + "/models").json()
        text = str(listing)
        assert "generation.max_num_seqs" in text and "greater than or equal to 1" in text, text


def test_max_tokens_past_the_context_is_refused_and_the_default_stops_at_its_end(model_dir):
    """A request's own max_tokens past the context is a 400 naming max_tokens (OpenAI and vLLM refuse it);
    the server's default is cut at the context's end instead."""
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)

    def messages(words):
        return [{"role": "user", "content": " ".join(["assignment target"] * words)}]

    def length(words):
        return len(tok.apply_chat_template(messages(words), add_generation_prompt=True, tokenize=True, return_dict=False))

    # the longest chat prompt that leaves the context less room than the default's 7 tokens
    words = max(w for w in range(1, 40) if length(w) <= 77)
    n_prompt = length(words)
    assert 74 <= n_prompt <= 77, n_prompt
    room = 80 - n_prompt
    with ServerProcess(str(model_dir), "--threads", "1", "--generation", "default_max_tokens=7,max_model_len=80",
                       env={"SURGE_GENERATION_CACHE_ENTRIES": "0"}) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        common = {"model": "tiny-gpt2", "temperature": 0, "extra_body": {"ignore_eos": True}}
        r = client.chat.completions.create(messages=messages(words), **common)  # the default: cut at the end
        assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == room
        assert r.choices[0].finish_reason == "length"
        r = client.chat.completions.create(messages=messages(words), max_tokens=room, **common)  # exactly fits
        assert r.usage.completion_tokens == room
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(messages=messages(words), max_tokens=room + 1, **common)
        assert err.value.body["param"] == "max_tokens" and "context is 80 tokens" in err.value.body["message"]
        ids = list(range(5, 75))  # 70 token ids: completions' max_tokens checked per prompt
        assert client.completions.create(prompt=ids, max_tokens=10, **common).usage.completion_tokens == 10
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(prompt=[ids[:10], ids], max_tokens=11, **common)
        assert err.value.body["param"] == "max_tokens"
        with pytest.raises(openai.BadRequestError):  # OpenAI's completions default is 16 tokens
            client.completions.create(prompt=ids, **common)
        text = tok.decode(ids)
        n_text = len(tok(text)["input_ids"])
        for path, body in (("/v2/models/tiny-gpt2/generate", {"text_input": text, "max_tokens": 81 - n_text}),
                           ("/v2/models/tiny-gpt2/generate", {"text_input": text,
                                                               "parameters": {"max_tokens": 81 - n_text}})):
            r = httpx.post(srv.url + path, json=body, timeout=60)
            assert r.status_code == 400 and "max_tokens" in r.text, r.text
        r = httpx.post(srv.url + "/v2/models/tiny-gpt2/generate", timeout=60,
                       json={"text_input": text, "parameters": {"ignore_eos": True, "temperature": 0}})
        assert r.status_code == 200, r.text  # no max_tokens: the default, cut at the context's end

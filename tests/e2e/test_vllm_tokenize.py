"""vLLM's /tokenize and /detokenize on a real `surge serve` process of a decoder: the tokens are transformers'
tokenizer's (a prompt with and without special tokens, its token strings, chat messages as apply_chat_template
tokenizes them with and without the generation prompt), detokenize gives transformers' decode of them; TEI's
/tokenize still answers its own body shape on the same path; bad bodies get 400 / 404 / 422."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.decoder_models import build_model  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

NAME = "tok-qwen"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = build_model("qwen2", tmp_path_factory.mktemp("tok") / NAME, seed=4)
    with ServerProcess(str(d), "--threads", "1") as srv:
        yield srv, transformers.AutoTokenizer.from_pretrained(str(d))


def _post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_tokenize_a_prompt_and_back(server):
    srv, tok = server
    text = "Hello there, surge! Tokens: 12345 and émigré."
    r = _post(srv, "/tokenize", {"model": NAME, "prompt": text})
    assert r.status_code == 200, r.text
    got = r.json()
    want = tok(text, add_special_tokens=True)["input_ids"]
    assert got["tokens"] == want and got["count"] == len(want) and got["token_strs"] is None
    assert got["max_model_len"] == tok.model_max_length or got["max_model_len"] > 0
    plain = _post(srv, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert plain["tokens"] == tok(text, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    back = _post(srv, "/detokenize", {"model": NAME, "tokens": got["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == tok.decode(want), back.text


def test_tokenize_chat_messages_as_the_template_renders_them(server):
    srv, tok = server
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Define assignment."}]
    r = _post(srv, "/tokenize", {"model": NAME, "messages": messages})
    assert r.status_code == 200, r.text
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.json()["tokens"] == want
    no_prompt = _post(srv, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                                          return_dict=False)
    assert no_prompt["count"] < len(want)
    # back to text with the template's special tokens written out, as transformers decodes them
    back = _post(srv, "/detokenize", {"tokens": want}).json()["prompt"]
    assert back == tok.decode(want) and back.startswith("<|im_start|>")


def test_bad_bodies_and_teis_own_shape(server):
    srv, tok = server
    assert _post(srv, "/detokenize", {"tokens": [10 ** 7]}).status_code == 400
    assert _post(srv, "/tokenize", {"messages": []}).status_code in (400, 422)
    assert _post(srv, "/tokenize", {"prompt": 5}).status_code in (400, 422)
    both = _post(srv, "/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True})
    assert both.status_code == 400 and "continue_final_message" in both.text
    assert _post(srv, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    tei = _post(srv, "/tokenize", {"inputs": "Hello there"})  # TEI's body on the same path
    assert tei.status_code == 200, tei.text
    assert [t["id"] for t in tei.json()[0]] == tok("Hello there", add_special_tokens=True)["input_ids"]

"""What one request's structured output can cost the engine that every stream shares: a real `surge serve`
process of a tiny decoder (its engine loop in a process of its own, the default), called over HTTP. Each test
failed before its fix (session 48's security review):

- a guide that llguidance's parser gives up on within its first tokens (a regex `x a{1000}{1000}`, a grammar of
  the same lexeme, 20,000 choices: past the parser's lexer or row limits) passed the front end's check, which
  only asked whether a first token exists. Each of the request's `n` sequences then built the guide's lexer
  from scratch in the engine's step (~0.8 s of CPU each, every other stream waiting: n=8 held a neighbour's
  2-token answer ~8 s), and the request got a misleading 400 ("left no token", param `prompt`). Now the check
  also takes the guide past its first token: a 400 naming the field and the reason, and the engine
  never sees the request (counted: no failed generation step in the server's log);
- llguidance's mask costs each sequence time in proportion to the text its guide forces next (~0.15 us a
  byte, every step): one 250 KB choice, a JSON `const` or a regex `a{500}{500}` cost ~40-150 ms per sequence
  per step of the engine, every stream waiting (n=8 and 40 tokens held neighbours' answers 1-3 s each, the
  request 16 s). A guide that forces more than MAX_FORCED_BYTES at its start is a 400 naming its field; one
  that gets there later (an alternative the model takes) fails its own sequences in the engine, before their
  mask is computed, and nobody else's.
"""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("llguidance")

from tests.decoder_models import build_model  # noqa: E402
from tests.server_process import ServerProcess  # noqa: E402

NAME = "guide-qwen"
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = build_model("qwen2", tmp_path_factory.mktemp("guides") / NAME, seed=5)
    with ServerProcess(str(d), "--threads", "1", "--generation", "engine_process=true") as srv:
        yield srv


def _failed_steps(srv) -> int:
    return srv.output(tail=1 << 22).count("generation step failed")


@pytest.mark.parametrize("field, value, limit", [
    ("guided_regex", "xa{1000}{1000}", "forces"),  # past the first token: 1 MB forced (the lexer gives up there)
    ("guided_grammar", "start: /xa{1000}{1000}/", "forces"),
    ("guided_choice", [f"c{i}x" for i in range(20_000)], "items"),
], ids=["regex", "grammar", "choice"])
def test_a_guide_past_the_parsers_limits_is_refused_before_the_engine(server, field, value, limit):
    before = _failed_steps(server)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": NAME, "messages": ASK, "max_tokens": 3, "n": 8, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert "limits" in err["message"] and limit in err["message"], err["message"]
    assert "<state>" not in err["message"] and "<grammar>" not in err["message"]  # the parser's dump stays out
    assert _failed_steps(server) == before, server.output(tail=4000)
    # the same route over KServe's generate extension
    g = httpx.post(f"{server.url}/v2/models/{NAME}/generate", timeout=120,
                   json={"text_input": "hi", "parameters": {"max_tokens": 3, field: value}})
    assert g.status_code == 400 and "limits" in g.json()["error"], g.text
    assert _failed_steps(server) == before


def test_guides_within_the_limits_still_hold_the_answer(server):
    for field, value in (("guided_regex", "a{3}b{2}"), ("guided_choice", ["ab", "ba"]),
                         ("guided_grammar", 'start: "a" /b{2,3}/')):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"model": NAME, "messages": ASK, "max_tokens": 8, "n": 2, field: value})
        assert r.status_code == 200, r.text
        texts = [c["message"]["content"] for c in r.json()["choices"]]
        if field == "guided_regex":
            assert texts == ["aaabb", "aaabb"], texts
        elif field == "guided_choice":
            assert all(t in value for t in texts), texts
        else:
            assert all(t in ("abb", "abbb") for t in texts), texts
    assert json.loads(httpx.get(server.url + "/health", timeout=30).text or "{}") is not None


@pytest.mark.parametrize("field, value", [
    ("guided_choice", ["a" * 250_000]),
    ("guided_regex", "a{500}{500}"),
    ("guided_json", {"const": "a" * 250_000}),
], ids=["choice", "regex", "json"])
def test_a_guide_forcing_a_long_text_is_refused_before_the_engine(server, field, value):
    from surge.runtime.guided import MAX_FORCED_BYTES

    before = _failed_steps(server)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": NAME, "messages": ASK, "max_tokens": 40, "n": 8, field: value})
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == field and f"{MAX_FORCED_BYTES:,}" in err["message"], err
    assert _failed_steps(server) == before
    # one just under the bound is still held
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                    json={"model": NAME, "messages": ASK, "max_tokens": 3, "guided_choice": ["a" * (MAX_FORCED_BYTES - 8)]})
    assert ok.status_code == 200 and set(ok.json()["choices"][0]["message"]["content"]) == {"a"}, ok.text[:300]


def test_a_long_forced_text_reached_later_fails_its_own_sequences_only(server):
    """`a|ba{500}{500}` forces nothing at its start, and the check's first token (`a`) ends it; a logit bias
    makes the model take the `b` branch, which forces ~250 KB: its sequences fail (400) in the engine (a failed
    step in the log) before their masks are computed again; a neighbour generating beside them answers in full."""
    import threading

    def token(text):
        ids = httpx.post(server.url + "/tokenize", json={"model": NAME, "prompt": text, "add_special_tokens": False},
                         timeout=30).json()["tokens"]
        assert len(ids) == 1
        return ids[0]

    assert token("a") < token("b")  # the check takes the first token the guide accepts: `a`
    got = {}

    def neighbour():
        got["r"] = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                              json={"model": NAME, "messages": ASK, "max_tokens": 30, "ignore_eos": True})

    before = _failed_steps(server)
    log_before = len(server.output(tail=1 << 30))
    t = threading.Thread(target=neighbour)
    t.start()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": NAME, "messages": ASK, "max_tokens": 40, "n": 4,
                         "guided_regex": "a|ba{500}{500}", "logit_bias": {str(token("b")): 100}})
    t.join()
    assert r.status_code == 400, r.text[:300]
    assert "forces" in r.json()["error"]["message"], r.text[:300]
    assert _failed_steps(server) > before  # the engine's backstop, not the check
    # the request's own fault: logged in a line naming its sequences, not a traceback a client can repeat at will
    logged = server.output(tail=1 << 30)[log_before:]
    assert "failed by their own request" in logged and "Traceback" not in logged, logged[-4000:]
    assert got["r"].status_code == 200 and got["r"].json()["usage"]["completion_tokens"] == 30, got["r"].text

"""Long lists of messages are validated with a Python call per item (server/http/gil_points.py), so the thread
that validates a large body lets the event loop have the GIL every switch interval instead of holding it for
the whole native validation (~50-100 ms for 45,000 messages). Observed without timing: a profile hook counts
the Python calls made while pydantic validates. The validated values and the errors are unchanged."""

from __future__ import annotations

import sys

import pytest
from pydantic import ValidationError

from surge.server.http import fail_fast
from surge.server.http.anthropic_messages import CountTokensRequest, MessagesRequest
from surge.server.http.common import validate
from surge.server.http.openai_chat_requests import ChatCompletionRequest
from surge.server.http.vllm_tokenize import TokenizeChat

N = 3000
TURNS = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"turn {k}"} for k in range(N)]
MODELS = [(ChatCompletionRequest, {"model": "m"}), (TokenizeChat, {"model": "m"}),
          (MessagesRequest, {"model": "m", "max_tokens": 4}), (CountTokensRequest, {"model": "m"})]


def _python_calls(fn) -> tuple[int, object]:
    calls = 0

    def hook(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(hook)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return calls, out


@pytest.mark.parametrize("model,rest", MODELS, ids=[m[0].__name__ for m in MODELS])
def test_validating_many_messages_passes_through_python_for_each(model, rest):
    body = {**rest, "messages": TURNS}
    calls, req = _python_calls(lambda: model.model_validate(body))
    assert calls >= N, calls  # a point for each message where the GIL can change hands
    assert [m.content for m in req.messages] == [t["content"] for t in TURNS]
    # the fail-fast twin that checks a large body first has them too
    fail_fast.BODY_SIZE.set(10 * fail_fast.PRECHECK_BYTES)
    calls, _ = _python_calls(lambda: fail_fast.check(model, body))
    assert calls >= N, calls


@pytest.mark.parametrize("model,rest", MODELS, ids=[m[0].__name__ for m in MODELS])
def test_the_errors_of_a_bad_message_are_unchanged(model, rest):
    bad = [*TURNS[:7], {"role": "robot", "content": "x"}, *TURNS[7:]]
    with pytest.raises(ValidationError) as exc:
        model.model_validate({**rest, "messages": bad})
    first = exc.value.errors()[0]
    assert first["loc"][:3] == ("messages", 7, "role") and first["type"] == "literal_error"
    with pytest.raises(Exception) as msg:
        validate(model, {**rest, "messages": bad})
    assert "messages.7.role" in str(msg.value)

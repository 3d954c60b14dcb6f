"""Request fields that are unions of list types (a prompt or input as texts, token ids, or lists of either):
pydantic validates a value against every choice of the union, and a list choice it does not fit collected one
error per item. A valid 900,000-id prompt made 900,000 errors in its list-of-strings choice, thrown away, ~180 ms
of the GIL on the VM (the event loop's time too: benchmarks/loop_stall.py). Each list choice now stops at its
first bad item: a body of many items refused by every choice carries one error a choice, the message the routes
give is the same as for the same mistake in a short body, and valid bodies validate to the same values."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from surge.errors import Unprocessable
from surge.server.http import fail_fast
from surge.server.http.common import validate
from surge.server.http.native import EmbedRequest
from surge.server.http.openai import EmbeddingsRequest
from surge.server.http.openai_chat_requests import CompletionRequest
from surge.server.http.tei import DecodeRequest

N = 50_000
# model, its union field, the other fields a body needs
MODELS = [(CompletionRequest, "prompt", {"model": "m"}), (EmbeddingsRequest, "input", {"model": "m"}),
          (EmbedRequest, "inputs", {}), (DecodeRequest, "ids", {})]
# values that every choice refuses, their bad item last: ids then a string; id lists then a bare id
BAD = [lambda n: [7] * n + ["x"], lambda n: [[7, 8]] * n + [7], lambda n: ["a"] * n + [[7]]]


def _refusal(model, field, rest, value) -> tuple[ValidationError, str]:
    body = {**rest, field: value}
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    with pytest.raises(Unprocessable) as msg:
        fail_fast.BODY_SIZE.set(10 * N)
        validate(model, body)
    return exc.value, str(msg.value)


@pytest.mark.parametrize("model,field,rest", MODELS, ids=[m[0].__name__ for m in MODELS])
@pytest.mark.parametrize("bad", range(len(BAD)))
def test_a_long_value_that_no_choice_takes_makes_one_error_a_choice(model, field, rest, bad):
    choices = len(model.model_fields[field].annotation.__args__)
    long, long_msg = _refusal(model, field, rest, BAD[bad](N))
    assert long.error_count() <= choices, long.error_count()
    # the message the client reads is the one the same mistake in a short body gets (index aside)
    _, short_msg = _refusal(model, field, rest, BAD[bad](3))
    assert long_msg.replace(str(N), "I") == short_msg.replace("3", "I")


@pytest.mark.parametrize("model,field,rest", MODELS, ids=[m[0].__name__ for m in MODELS])
def test_valid_long_values_validate_to_the_same_lists(model, field, rest):
    values = [[7] * N, [[7, 8]] * N, ["a b"] * N]
    if model is DecodeRequest:  # ids only: texts are a shape it does not take
        with pytest.raises(ValidationError):
            model.model_validate({**rest, field: values.pop()})
    for value in values:
        got = getattr(model.model_validate({**rest, field: value}), field)
        assert got == value and type(got) is list

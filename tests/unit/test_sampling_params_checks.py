"""SamplingParams refuses values of the wrong type at the edge, and a temperature too small to divide by is
greedy. A value the sampler cannot use (a float top_k, a string seed, a token id past the vocabulary) raised
inside the engine's step, which fails every sequence sharing the step: other users' streams ended with 500s."""

from __future__ import annotations

import pytest

from surge.errors import InvalidInput
from surge.runtime.scheduler import SamplingParams

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 2.5), ("max_tokens", True), ("min_tokens", 1.5), ("top_k", 1.5), ("top_k", "3"),
    ("seed", "x"), ("seed", 1.5), ("seed", True), ("seed", [1]), ("temperature", "1"), ("top_p", None),
    ("stop", (5,)), ("stop_token_ids", ("a",)), ("stop_token_ids", (-3,)), ("stop_token_ids", (None,)),
    ("ignore_eos", "false"), ("include_stop_str_in_output", 1), ("skip_special_tokens", "no"),
    ("logprobs", 1.5), ("presence_penalty", "0"), ("allowed_token_ids", (1.5,)),
])
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidInput) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field, (err.value.param, err.value.message)


def test_values_of_the_right_types_pass():
    p = SamplingParams(max_tokens=3, min_tokens=1, top_k=-1, seed=2**70, temperature=1, top_p=1, stop=("a",),
                       stop_token_ids=(1, 2), ignore_eos=True, logprobs=0, presence_penalty=1,
                       allowed_token_ids=(4,))
    assert p.seed == 2**70 and not p.greedy


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45])
def test_a_temperature_too_small_to_divide_by_samples_greedily(temperature):
    """Dividing logits by ~1e-38 overflows to inf, the softmax to NaN, and the race picked token 0."""
    from surge.engines.decoder.sampler import Sampler
    from surge.runtime.scheduler import Sequence

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn((3, 50), generator=gen) * 5
    logits[:, 17] = 30.0
    seqs = [Sequence(i, [1, 2], SamplingParams(temperature=temperature, seed=s, max_tokens=4))
            for i, s in enumerate((None, 3, 4))]
    out = Sampler(torch.device("cpu"))(logits, seqs)
    assert [o.token for o in out] == [17, 17, 17]
    assert SamplingParams(temperature=temperature).greedy
    assert SamplingParams(temperature=temperature).key() == SamplingParams(temperature=0).key()


def test_key_and_packed_params_are_those_of_the_fields():
    """key() takes the fields as they are (asdict's deep copy of 100,000 bad words took 0.6 s of the event
    loop): the same key as asdict's; pack() pickles ahead, and the params that travel are equal."""
    import pickle
    from dataclasses import asdict, replace

    p = SamplingParams(max_tokens=5, temperature=0.0, seed=3, stop=("x", "yz"), stop_token_ids=(1, 2),
                       logit_bias=((3, -1.0), (9, 2.5)), guide=("regex", "[ab]+"), allowed_token_ids=(3, 4, 9),
                       bad_words_ids=((5,), (6, 7)), own_max_tokens=True, priority=2)
    d = asdict(p)
    for k in ("extra", "own_max_tokens", "priority", "temperature", "top_k", "top_p", "min_p", "seed"):
        d.pop(k)
    assert p.key() == tuple(sorted(d.items()))
    assert hash(p.key()) == hash(tuple(sorted(d.items())))
    before = pickle.loads(pickle.dumps(p))
    p.pack()
    after = pickle.loads(pickle.dumps(("add", [p, p])))
    assert after[1][0] == before == p and after[1][0] is after[1][1]
    assert after[1][0].own_max_tokens and after[1][0].priority == 2  # fields eq leaves out travel too
    assert replace(p, seed=4).seed == 4 and pickle.loads(pickle.dumps(replace(p, seed=4))).seed == 4

"""The sampler's per-step bans and biases (bad words, logit_bias, allowed_token_ids, min_tokens) against their
definitions applied in float64 to the same random logits: vLLM's bad_words (a one-token word never drawn; a longer
word's last token not drawn where the output ends with the rest of it), OpenAI's logit_bias (added), vLLM's
allowed_token_ids (the others never drawn), min_tokens (no stop token yet). Many random words of mixed lengths,
sharing prefixes and last tokens, over random outputs that end with some of them: the indexed form
(SamplingParams.bad_word_index) bans exactly what the rule bans."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from surge.engines.decoder.sampler import Sampler  # noqa: E402
from surge.runtime.scheduler import SamplingParams, Sequence  # noqa: E402

V = 97


def reference(logits: np.ndarray, p: SamplingParams, out: list[int], eos=()) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for t, b in p.logit_bias:
        x[t] += b
    for w in p.bad_words_ids:
        if len(w) == 1 or (len(out) >= len(w) - 1 and tuple(out[len(out) - len(w) + 1:]) == w[:-1]):
            x[w[-1]] = -np.inf
    if p.min_tokens and len(out) < p.min_tokens:
        for t in p.stop_token_ids + (() if p.ignore_eos else tuple(eos)):
            x[t] = -np.inf
    if p.allowed_token_ids:
        keep = np.full(V, -np.inf)
        keep[list(p.allowed_token_ids)] = 0.0
        x = x + keep
    return x


def random_case(rng: random.Random):
    words = set()
    for _ in range(rng.randrange(1, 400)):
        n = rng.choice((1, 2, 2, 3, 3, 4))
        words.add(tuple(rng.randrange(V) for _ in range(n)))
    words = sorted(words, key=lambda w: rng.random())
    out = [rng.randrange(V) for _ in range(rng.randrange(0, 8))]
    longer = [w for w in words if len(w) > 1]
    if longer and rng.random() < 0.7:  # the output ends with some word's prefix: its last token is banned
        w = rng.choice(longer)
        out = out + list(w[:-1])
    bias = tuple((rng.randrange(V), rng.uniform(-5, 5)) for _ in range(rng.randrange(0, 20)))
    allowed = tuple(rng.sample(range(V), rng.randrange(V // 2, V))) if rng.random() < 0.3 else ()
    params = SamplingParams(max_tokens=50, min_tokens=rng.choice((0, 20)), stop_token_ids=(3, 5),
                            bad_words_ids=tuple(words), logit_bias=bias, allowed_token_ids=allowed)
    return params, out


@pytest.mark.parametrize("seed", range(6))
def test_bans_and_biases_equal_their_definitions(seed):
    rng = random.Random(seed)
    sampler = Sampler(torch.device("cpu"), eos_ids=(7,))
    cases = [random_case(rng) for _ in range(8)]
    logits = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    want = np.stack([reference(logits[i].numpy(), p, out, eos=(7,)) for i, (p, out) in enumerate(cases)])
    seqs = []
    for i, (p, out) in enumerate(cases):
        s = Sequence(i, [1, 2], p)
        s.output_ids, s.token_ids = list(out), [1, 2] + list(out)
        seqs.append(s)
    got = logits.clone()
    sampler._penalize(got, seqs)
    assert (np.isinf(want) == np.isinf(got.numpy())).all()
    assert np.allclose(np.where(np.isinf(want), 0, want), np.where(np.isinf(got.numpy()), 0, got.numpy()), atol=1e-12)
    assert any(np.isinf(w).sum() > 1 for w in want)  # bans happened (words of several lengths met)


def test_the_index_travels_with_the_params_and_changes_neither_key_nor_equality():
    p = SamplingParams(bad_words_ids=((4,), (1, 2), (9, 1, 2)), logit_bias=((3, 1.5),))
    q = pickle.loads(pickle.dumps(p))
    key = p.key()
    always, by_len = p.bad_word_index
    assert always.tolist() == [4] and by_len == ((1, {(1,): [2]}), (2, {(9, 1): [2]}))
    assert p.banned_after([5, 1]) == [2] and p.banned_after([9, 1]) == [2, 2] and p.banned_after([1, 9]) == []
    assert p == q and p.key() == key == q.key() and pickle.loads(pickle.dumps(p)) == p

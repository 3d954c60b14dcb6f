"""A decoder served as an embedding model is batch invariant on the CPU (batch_invariant, the default): a
sentence's hidden states are bit for bit the same alone and in any batch (DESIGN.md), on the TorchScript
forward (GEMMs at probed row counts, each sequence in a causal attention block of its own) and the eager one
(each sequence alone), in fp32 and bf16, at 1 and 2 threads, for Qwen3 (q/k norms), Qwen2 (q/k/v biases) and
Mistral layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.engines.decoder.embedder import DecoderEmbedder
from surge.types import TokenBatch
from tests.batch_moves import moved
from tests.decoder_models import build_embedding_model


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "mistral"])
def model(request, tmp_path_factory, sentences):
    """The model and every shipped sentence tokenized by it (its 48-token limit cuts the longest), with a few
    single words."""
    from surge.models import load_model_spec
    from surge.runtime.tokenize import Tokenizer

    d = build_embedding_model(request.param, tmp_path_factory.mktemp("inv_" + request.param) / "m", seed=5,
                              num_hidden_layers=2)
    spec = load_model_spec(d)
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    items = tok.encode(list(sentences) + ["Hi", "Paris?", "ok then"])
    assert min(len(it.ids) for it in items) < 8 and max(len(it.ids) for it in items) == spec.max_length
    return d, items


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("script", [True, False], ids=["script", "eager"])
def test_every_sentence_alone_equals_itself_in_random_batches(model, precision, threads, script):
    d, items = model
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = DecoderEmbedder(precision=precision, cpu_script=script)  # batch_invariant: the default
        engine.load(d)
        assert engine.batch_invariant and (engine._script is not None) == script
        got = moved(lambda its: engine.run(TokenBatch.pack(its)), items, np.random.default_rng(), 6)
        engine.close()
    finally:
        torch.set_num_threads(before)
    assert not got, f"{precision}, {threads} threads: {len(got)} of {len(items)} sentences moved"


def test_the_invariant_form_equals_the_batched_one_within_rounding(model):
    """The invariant layout computes the same function as the batch-shaped one (block-diagonal causal blocks,
    one GEMM call), only its rounding is fixed: within fp32 rounding of each other on real sentences."""
    d, items = model
    inv, free = DecoderEmbedder(), DecoderEmbedder(batch_invariant=False)
    inv.load(d)
    free.load(d)
    batch = TokenBatch.pack(items[:40])
    a, b = inv.run(batch), free.run(batch)
    assert a.shape == b.shape == (int(batch.lengths.sum()), inv.capabilities.hidden_size)
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)
    assert np.abs(a).max() > 0.1

"""surge's CPU path against the PyTorch FP32 reference on real sentences."""

import numpy as np

from surge.types import EmbedOptions
from tests.conftest import cosine_rows


def test_bundled_embeddings_match_reference(bundled_worker, reference_embed, sentences):
    long_text = " ".join(sentences[:40])  # far past the 256-token maximum: must be truncated the same way
    texts = sentences[:250] + [long_text, "Hi", "What's the weather in Paris tomorrow?"]
    assert len(bundled_worker.tokenizer.encode([long_text])[0]) == bundled_worker.tokenizer.max_length
    ref = reference_embed(texts)
    got = []
    for i in range(0, len(texts), 16):  # batches of mixed lengths, padded per batch
        items = bundled_worker.tokenizer.encode(texts[i : i + 16])
        got.append(bundled_worker.finish(bundled_worker.compute(items), EmbedOptions()))
    got = np.concatenate(got)
    cos = cosine_rows(got, ref)
    assert got.shape == ref.shape == (len(texts), 384)
    assert cos.min() >= 0.99999, f"worst cosine {cos.min():.7f} at {texts[int(cos.argmin())][:60]!r}"
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_batch_composition_does_not_change_results(bundled_worker, sentences):
    rng = np.random.default_rng()
    texts = [sentences[i] for i in rng.choice(len(sentences), 24, replace=False)]
    alone = np.concatenate([bundled_worker.compute(bundled_worker.tokenizer.encode([t])) for t in texts])
    together = bundled_worker.compute(bundled_worker.tokenizer.encode(texts))
    assert cosine_rows(alone, together).min() >= 0.999999

"""A decoder embedding model (Qwen3-Embedding's layout) on a CUDA GPU through the server's worker (its
batches replayed from CUDA graphs of their buckets): FP32 equals sentence-transformers' FP32 vectors on the
CPU, BF16 within its rounding; each row alone equals its row in the batch; the eager packed path agrees;
a batch past the graphs' buckets runs eagerly."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("precision,atol,min_cos", [("fp32", 2e-4, 0.99999), ("bf16", None, 0.99)])
def test_decoder_embeddings_on_the_gpu(tmp_path, sentences, precision, atol, min_cos):
    from sentence_transformers import SentenceTransformer

    from surge.config import EngineConfig
    from surge.engines.pooling import l2_normalize
    from surge.models import load_model_spec
    from surge.runtime.loader import build_worker
    from surge.types import EmbedOptions
    from tests.decoder_models import build_embedding_model

    d = build_embedding_model("qwen3", tmp_path / "m", seed=9, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    worker = build_worker(load_model_spec(d), None, EngineConfig(engine="torch", device="cuda", precision=precision))
    assert worker.engines.capabilities.device.startswith("cuda")
    texts = sentences[:40:2] + ["Hi"]
    items = worker.tokenizer.encode(texts)
    got = worker.finish(worker.compute(items), EmbedOptions())
    ref = SentenceTransformer(str(d), device="cpu").encode(texts, convert_to_numpy=True)
    cos = (got * ref).sum(1)
    assert cos.min() >= min_cos, cos
    if atol is not None:
        np.testing.assert_allclose(got, ref, atol=atol)
    close = 0.99999 if precision == "fp32" else 0.999
    for i in (0, 5, len(items) - 1):
        alone = l2_normalize(worker.compute([items[i]]))[0]
        assert float(alone @ got[i]) >= close
    engine = worker.engines.engines[0]
    assert engine._graphs, "the batches ran from CUDA graphs"
    engine.cuda_graphs = False
    eager = worker.finish(worker.compute(items), EmbedOptions())
    assert (eager * got).sum(1).min() >= close
    from surge.engines.decoder import embedder

    many = worker.tokenizer.encode(sentences[:embedder.ROW_BUCKETS[-1] + 1])  # more rows than any bucket
    engine.cuda_graphs = True
    big = worker.finish(worker.compute(many), EmbedOptions())
    assert (big[:1] @ worker.finish(worker.compute(many[:1]), EmbedOptions()).T).min() >= close


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_decoder_embeddings_are_batch_invariant_on_the_gpu(tmp_path, sentences, precision, graphs):
    """batch_invariant (the default): every sentence's hidden states alone equal theirs in random batches of
    2-64 (CUDA graphs of several buckets, or the eager packed forward), bit for bit; and they stay within
    rounding of the batch-shaped engine (cuBLAS, SDPA)."""
    from surge.engines.decoder.embedder import DecoderEmbedder
    from surge.models import load_model_spec
    from surge.runtime.tokenize import Tokenizer
    from surge.types import TokenBatch
    from tests.batch_moves import moved
    from tests.decoder_models import build_embedding_model

    d = build_embedding_model("qwen3", tmp_path / "m", seed=4, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    spec = load_model_spec(d)
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    items = tok.encode(list(sentences) + ["Hi", "ok then"])
    engine = DecoderEmbedder(device="cuda", precision=precision, cuda_graphs=graphs)
    engine.load(d)
    assert engine.batch_invariant and engine.model.batch_invariant
    run = lambda its: engine.run(TokenBatch.pack(its))  # noqa: E731
    got = moved(run, items, np.random.default_rng(), 8)
    assert not got, f"{precision}: {len(got)} of {len(items)} sentences moved"
    assert bool(engine._graphs) == graphs
    free = DecoderEmbedder(device="cuda", precision=precision, cuda_graphs=graphs, batch_invariant=False)
    free.load(d)
    batch = TokenBatch.pack(items[:48])
    a, b = engine.run(batch), free.run(batch)
    cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert cos.min() >= (0.99999 if precision == "fp32" else 0.999), cos.min()

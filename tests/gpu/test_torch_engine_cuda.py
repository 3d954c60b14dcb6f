"""The CUDA engine on the bundled MiniLM against the FP32 reference, every sentence
(model_dir, reference, tokenizer: tests/gpu/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.engines.pooling import l2_normalize, pool
from surge.types import TokenBatch
from tests.conftest import cosine_rows

pytestmark = pytest.mark.cuda


def embed(engine, tokenizer, texts, bs=32, padded=False):
    """Pooled, normalized sentence vectors, `bs` texts a batch."""
    out = []
    for i in range(0, len(texts), bs):
        items = tokenizer.encode(texts[i:i + bs])
        batch = TokenBatch.pad(items) if padded else TokenBatch.pack(items)
        out.append(l2_normalize(pool(engine.run(batch), batch, "mean")))
    return np.concatenate(out)


@pytest.mark.parametrize("precision,floor", [("fp16", 0.9999), ("bf16", 0.999)])
def test_every_sentence_matches_fp32_reference(model_dir, tokenizer, reference, sentences, precision, floor):
    from surge.engines.torch_gpu import TorchEngine

    engine = TorchEngine(device="cuda", precision=precision, max_batch=32)
    engine.load(model_dir)
    got = embed(engine, tokenizer, sentences)
    cos = cosine_rows(got, reference)
    print(f"{precision}: min cosine {cos.min():.6f} mean {cos.mean():.6f} over {len(cos)} sentences")
    assert cos.min() >= floor, f"worst {cos.min():.6f} at {sentences[int(cos.argmin())][:60]!r}"
    # padded input and the uncaptured path (cuBLAS GEMMs throughout, while the captured
    # engine may have picked Triton's FFN GEMM for a bucket) agree to the precision's rounding
    eager = TorchEngine(device="cuda", precision=precision, max_batch=32, cuda_graphs=False)
    eager.load(model_dir)
    sub = sentences[:64]
    same = 0.99999 if precision == "fp16" else 0.9999
    assert cosine_rows(embed(eager, tokenizer, sub, bs=13, padded=True), got[:64]).min() >= same


def test_graph_replays_follow_new_contents(model_dir, tokenizer, sentences):
    """One bucket, three batches: replays must read the new inputs every time."""
    from surge.engines.torch_gpu import TorchEngine

    engine = TorchEngine(device="cuda", precision="fp16", max_batch=8)
    engine.load(model_dir)
    rng = np.random.default_rng()
    a = tokenizer.encode([sentences[i] for i in rng.choice(len(sentences), 8, replace=False)])
    b = tokenizer.encode([sentences[i] for i in rng.choice(len(sentences), 7, replace=False)])
    ra = engine.run(TokenBatch.pack(a))
    rb = engine.run(TokenBatch.pack(b))
    ra2 = engine.run(TokenBatch.pack(a))
    np.testing.assert_array_equal(ra, ra2)
    single = np.concatenate([engine.run(TokenBatch.pack([x])) for x in b])
    assert cosine_rows(single.astype(np.float32), rb.astype(np.float32)).min() > 0.9999


def test_out_of_memory_is_an_engine_error(model_dir):
    from surge.engines.torch_gpu import TorchEngine
    from surge.errors import EngineError

    free, _ = torch.cuda.mem_get_info()
    engine = TorchEngine(device="cuda", precision="fp16", max_batch=8, max_tokens=int(free // 1000))
    with pytest.raises(EngineError, match="memory"):
        engine.load(model_dir)


@pytest.mark.parametrize("gemm", ["cublas", "mixed", "triton", "cublaslt_gelu", "invariant"])
def test_gemm_modes_agree(model_dir, tokenizer, reference, sentences, gemm):
    from surge.engines.torch_gpu import TorchEngine

    engine = TorchEngine(device="cuda", precision="fp16", max_batch=64, gemm=gemm)
    engine.load(model_dir)
    rng = np.random.default_rng()
    idx = rng.choice(len(sentences), 100, replace=False)
    got = embed(engine, tokenizer, [sentences[i] for i in idx], bs=50)
    one = embed(engine, tokenizer, [sentences[idx[0]]], bs=1)
    cos = cosine_rows(np.concatenate([got, one]), reference[np.concatenate([idx, idx[:1]])])
    assert cos.min() >= 0.9999, f"{gemm}: worst {cos.min():.6f}"



def test_auto_times_every_mode_and_keeps_the_fastest(model_dir, tokenizer, sentences):
    from surge.engines import torch_graphs
    from surge.engines.torch_gpu import LT_GELU, TorchEngine

    torch_graphs._MODE_CHOICE.clear()  # earlier engines of this model shared their choices: time afresh
    engine = TorchEngine(device="cuda", precision="fp16", max_batch=8, batch_invariant=False)
    engine.load(model_dir)
    engine.run(TokenBatch.pack(tokenizer.encode(sentences[:3])))
    (key, timings), = engine.choices.items()
    assert LT_GELU in timings and "cublas" in timings, timings  # fp16 allows the tanh GeLU epilogue
    assert engine._graphs[key + (False,)][3] == min(timings, key=timings.get)  # graph keys: bucket + heads mode
    exact = TorchEngine(device="cuda", precision="fp16", max_batch=8, approximate_gelu=False, batch_invariant=False)
    exact.load(model_dir)
    assert LT_GELU not in exact.modes(key)

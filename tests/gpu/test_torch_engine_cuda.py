"""The CUDA engine on the bundled MiniLM against the FP32 reference, every sentence.

On a GPU machine without the bundled-model package, SURGE_GPU_MODEL_DIR points
at a copy of the model (weights may be stored in fp16) and SURGE_GPU_REF at the
FP32 reference vectors of all `load_sentences()` computed from the original
fp32 weights (benchmarks/gpu_prepare.py writes both).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from surge.engines.pooling import l2_normalize, pool
from surge.types import TokenBatch
from tests.conftest import cosine_rows

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def model_dir() -> Path:
    env = os.environ.get("SURGE_GPU_MODEL_DIR")
    if env:
        return Path(env)
    from surge.models import bundled_model_dir

    return bundled_model_dir()


@pytest.fixture(scope="module")
def reference(model_dir, sentences):
    env = os.environ.get("SURGE_GPU_REF")
    if env:
        return np.load(env)
    from surge.models import load_model_spec
    from tests.reference import TorchReference

    return TorchReference(load_model_spec(model_dir))(sentences)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from surge.models import load_model_spec
    from surge.runtime.tokenize import Tokenizer

    spec = load_model_spec(model_dir)
    return Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)


def _embed(engine, tokenizer, texts, bs=32, padded=False):
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
    got = _embed(engine, tokenizer, sentences)
    cos = cosine_rows(got, reference)
    print(f"{precision}: min cosine {cos.min():.6f} mean {cos.mean():.6f} over {len(cos)} sentences")
    assert cos.min() >= floor, f"worst {cos.min():.6f} at {sentences[int(cos.argmin())][:60]!r}"
    # padded input and the uncaptured path (cuBLAS GEMMs throughout, while the captured
    # engine may have picked Triton's FFN GEMM for a bucket) agree to the precision's rounding
    eager = TorchEngine(device="cuda", precision=precision, max_batch=32, cuda_graphs=False)
    eager.load(model_dir)
    sub = sentences[:64]
    same = 0.99999 if precision == "fp16" else 0.9999
    assert cosine_rows(_embed(eager, tokenizer, sub, bs=13, padded=True), got[:64]).min() >= same


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


@pytest.mark.parametrize("gemm", ["cublas", "mixed", "triton", "cublaslt_gelu", "cublas+l2", "cublaslt_gelu+l2"])
def test_gemm_modes_agree(model_dir, tokenizer, reference, sentences, gemm):
    from surge.engines.torch_gpu import TorchEngine

    engine = TorchEngine(device="cuda", precision="fp16", max_batch=64, gemm=gemm)
    engine.load(model_dir)
    rng = np.random.default_rng()
    idx = rng.choice(len(sentences), 100, replace=False)
    got = _embed(engine, tokenizer, [sentences[i] for i in idx], bs=50)
    one = _embed(engine, tokenizer, [sentences[idx[0]]], bs=1)
    cos = cosine_rows(np.concatenate([got, one]), reference[np.concatenate([idx, idx[:1]])])
    assert cos.min() >= 0.9999, f"{gemm}: worst {cos.min():.6f}"


@pytest.mark.parametrize("mode", ["small", "small+pdl", "small+split+pdl", "small+qkv+pdl", "small+qkv+pdl+l2"])
@pytest.mark.parametrize("precision,floor", [("fp16", 0.9999), ("bf16", 0.999)])
def test_small_batch_modes_match_reference(model_dir, tokenizer, reference, sentences, mode, precision, floor):
    """The 4-kernel layer (kernels/small_batch.py) on small buckets: every sentence, odd batch sizes."""
    from surge.engines.torch_gpu import TorchEngine

    engine = TorchEngine(device="cuda", precision=precision, max_batch=8, gemm=mode)
    engine.load(model_dir)
    lens = np.array([len(x) for x in tokenizer.encode(sentences)])
    idx = np.flatnonzero(lens <= 64)
    rng = np.random.default_rng()
    rng.shuffle(idx)
    got, used = [], []
    for i in range(0, len(idx), 3):  # batches of 3 (and a last, shorter one): <= 192 tokens, odd bucket sizes
        chunk = idx[i:i + 3]
        items = tokenizer.encode([sentences[j] for j in chunk])
        batch = TokenBatch.pack(items)
        got.append(l2_normalize(pool(engine.run(batch), batch, "mean")))
        used.extend(chunk)
    cos = cosine_rows(np.concatenate(got), reference[np.array(used)])
    assert cos.min() >= floor, f"{mode} {precision}: worst {cos.min():.6f}"
    ran = {g[3] for g in engine._graphs.values()}
    assert mode in ran, f"no bucket ran {mode}: {ran}"
    if "+split" not in mode:
        assert torch.count_nonzero(engine._small[1]) == 0  # the atomic accumulator is left zeroed


def test_auto_times_small_modes_on_small_buckets(model_dir, tokenizer, sentences):
    from surge.engines.torch_gpu import SMALL_MODES, TorchEngine

    engine = TorchEngine(device="cuda", precision="fp16", max_batch=8)
    engine.load(model_dir)
    engine.run(TokenBatch.pack(tokenizer.encode(sentences[:1])))
    (key, timings), = engine.choices.items()
    assert set(SMALL_MODES) <= set(timings), timings

"""The torch engine's fast CPU path (encoder_cpu) against transformers FP32 and the per-sequence reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.engines.encoder import forward_reference, position_ids
from surge.engines.encoder_cpu import AttentionPlan, CpuEncoder, _has_fused_linear
from surge.engines.encoder_weights import load_weights
from surge.engines.pooling import l2_normalize, pool
from surge.engines.torch_gpu import TorchEngine
from surge.runtime.tokenize import Tokenizer
from surge.types import Layout, TokenBatch
from tests.conftest import cosine_rows


@pytest.fixture(scope="module")
def tokenizer(bundled_spec):
    return Tokenizer(bundled_spec.tokenizer_file, bundled_spec.max_length, bundled_spec.vocab_size,
                     bundled_spec.pad_token_id)


@pytest.fixture(scope="module")
def all_reference(reference_embed, sentences):
    return reference_embed(sentences)


def _embed_all(engine, tokenizer, sentences, layout, rng) -> np.ndarray:
    """Every sentence, in batches of random sizes (1..48), so batch 1, short and long blocks all occur."""
    out, i = [], 0
    while i < len(sentences):
        n = int(rng.integers(1, 49))
        items = tokenizer.encode(sentences[i:i + n])
        batch = TokenBatch.pack(items) if layout is Layout.PACKED else TokenBatch.pad(items)
        out.append(l2_normalize(pool(engine.run(batch), batch, "mean")))
        i += n
    return np.concatenate(out)


@pytest.mark.parametrize("precision,floor", [("fp32", 0.99999), ("bf16", 0.999)])
def test_every_shipped_sentence_matches_transformers(bundled_spec, tokenizer, sentences, all_reference,
                                                     precision, floor):
    engine = TorchEngine(device="cpu", precision=precision, max_batch=64)
    engine.load(bundled_spec.path)
    # packed oneDNN GEMMs where this CPU has them for the dtype (bf16: not on AVX2-only CPUs)
    assert engine._cpu.fused == _has_fused_linear(torch.bfloat16 if precision == "bf16" else torch.float32)
    rng = np.random.default_rng()
    layout = Layout.PACKED if precision == "bf16" else Layout.PADDED
    cos = cosine_rows(_embed_all(engine, tokenizer, sentences, layout, rng), all_reference)
    assert cos.min() >= floor, f"{precision}: worst cosine {cos.min():.6f} (sentence {int(cos.argmin())})"
    engine.close()


def test_attention_blocks_keep_sequences_apart():
    """Blocks pack consecutive sequences; the mask lets each query see exactly its own sequence."""
    lengths = np.array([5, 20, 64, 3, 70, 9, 9])
    plan = AttentionPlan(lengths)
    assert plan.block == 70 and sum(plan.fill) == lengths.sum()
    assert all(f <= plan.block for f in plan.fill)
    seg_sizes = plan.mask[:, 0].sum(-1)  # keys each query may see
    for i, f in enumerate(plan.fill):
        seen = seg_sizes[i, :f].tolist()
        # every real query sees a whole sequence of this batch, and no padded key
        assert set(seen) <= set(lengths.tolist())
    assert AttentionPlan(np.array([17])).single


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("fused", [True, False])
def test_random_lengths_match_per_sequence_reference(bundled_spec, fused, invariant):
    """fp32 against encoder.forward_reference (attention one sequence at a time) on random token ids,
    in the batch's own layout and in the batch-invariant one (InvariantPlan)."""
    w = load_weights(bundled_spec.path)
    enc = CpuEncoder(w, fused=fused and torch.backends.mkldnn.is_available(), invariant=invariant)
    rng = np.random.default_rng()
    for lengths in (rng.integers(1, 40, size=int(rng.integers(2, 30))), np.array([int(rng.integers(60, 200)), 7]),
                    np.array([int(rng.integers(2, 30))])):
        ids = torch.from_numpy(rng.integers(1000, 30000, size=int(lengths.sum())))
        types = torch.from_numpy(rng.integers(0, 2, size=int(lengths.sum())))
        pos = torch.from_numpy(position_ids(lengths, 0))
        with torch.inference_mode():
            ref = forward_reference(w, ids, types, pos, [0] + np.cumsum(lengths).tolist())
            got = enc.forward(ids, types, pos, lengths)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_cpu_engine_thread_setting_applies(bundled_spec):
    before = torch.get_num_threads()
    try:
        engine = TorchEngine(device="cpu", precision="bf16", max_batch=4, threads=1)
        engine.load(bundled_spec.path)
        assert torch.get_num_threads() == 1
        engine.close()
    finally:
        torch.set_num_threads(before)


def test_model_yaml_selects_the_bf16_cpu_engine(tmp_path, bundled_spec, reference_embed, sentences):
    """`engine: {engine: torch, device: cpu, precision: bf16}` in a model.yaml builds a worker on encoder_cpu."""
    from surge.config import ModelFile, load_yaml_file
    from surge.runtime.loader import build_worker

    (tmp_path / "model.yaml").write_text("engine: {engine: torch, device: cpu, precision: bf16, threads: 1}\n")
    cfg = load_yaml_file(tmp_path / "model.yaml", ModelFile).engine
    before = torch.get_num_threads()
    try:
        worker = build_worker(bundled_spec, None, cfg)
        caps = worker.engines.capabilities
        assert (caps.device, caps.dtype, caps.layout) == ("cpu", "bf16", Layout.PACKED)
        texts = [sentences[i] for i in np.random.default_rng().choice(len(sentences), 20, replace=False)]
        got = l2_normalize(worker.compute(worker.tokenizer.encode(texts)))
        assert cosine_rows(got, reference_embed(texts)).min() >= 0.999
        worker.engines.close()
    finally:
        torch.set_num_threads(before)

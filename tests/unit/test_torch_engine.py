"""The torch engine's CPU path: structure and numerics against transformers (FP32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.engines.base import random_batch
from surge.engines.encoder import forward_reference, layer_reference, position_ids
from surge.engines.encoder_weights import load_weights, read_config, shard_layer
from surge.engines.pooling import l2_normalize, pool
from surge.engines.torch_gpu import TorchEngine, token_bucket
from surge.errors import ConfigError, InvalidInput
from surge.runtime.tokenize import Tokenizer
from surge.types import Layout, TokenBatch
from tests.conftest import cosine_rows


@pytest.fixture(scope="module")
def cpu_engine(bundled_spec):
    e = TorchEngine(device="cpu", precision="fp32", max_batch=32)
    e.load(bundled_spec.path)
    return e


@pytest.fixture(scope="module")
def tokenizer(bundled_spec):
    return Tokenizer(bundled_spec.tokenizer_file, bundled_spec.max_length, bundled_spec.vocab_size,
                     bundled_spec.pad_token_id)


@pytest.mark.parametrize("layout", [Layout.PACKED, Layout.PADDED])
def test_bundled_fp32_matches_reference(cpu_engine, tokenizer, reference_embed, sentences, layout):
    rng = np.random.default_rng()
    texts = [sentences[i] for i in rng.choice(len(sentences), 48, replace=False)] + ["Hi"]
    ref = reference_embed(texts)
    got = []
    for i in range(0, len(texts), 16):
        items = tokenizer.encode(texts[i:i + 16])
        batch = TokenBatch.pack(items) if layout is Layout.PACKED else TokenBatch.pad(items)
        got.append(l2_normalize(pool(cpu_engine.run(batch), batch, "mean")))
    cos = cosine_rows(np.concatenate(got), ref)
    assert cos.min() >= 0.99999, f"worst cosine {cos.min():.7f}"


def test_capabilities_say_packed(cpu_engine):
    caps = cpu_engine.capabilities
    assert caps.layout is Layout.PACKED and caps.hidden_size == 384 and caps.max_tokens == 512


def test_bad_input_is_a_clear_error(cpu_engine):
    b = random_batch(2, 8, 30522, Layout.PACKED)
    b.input_ids[3] = 10 ** 6
    with pytest.raises(InvalidInput, match="token ids"):
        cpu_engine.run(b)
    with pytest.raises(InvalidInput, match="max_batch"):
        cpu_engine.run(random_batch(33, 4, 30522, Layout.PACKED))


def test_batch_beyond_planned_tokens_is_refused_and_engine_keeps_serving(bundled_spec, reference_embed):
    from surge.engines.torch_gpu import TorchEngine
    from surge.errors import EngineError

    engine = TorchEngine(device="cpu", precision="fp32", max_batch=8, max_tokens=40)
    engine.load(bundled_spec.path)
    with pytest.raises(EngineError, match="planned capacity of 40"):
        engine.run(random_batch(3, 16, 30522, Layout.PACKED))  # 48 tokens
    ids = reference_embed.tok("turn on the lights")["input_ids"]
    from surge.types import Encoded

    hidden = engine.run(TokenBatch.pack([Encoded(np.array(ids), np.zeros(len(ids), dtype=np.int64))]))
    assert hidden.shape == (len(ids), 384) and np.isfinite(hidden).all()


def _hf_models():
    from transformers import BertConfig, DistilBertConfig, RobertaConfig

    small = dict(vocab_size=1200, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=80)
    return {
        "bert": BertConfig(**small, type_vocab_size=2),
        "bert_tanh": BertConfig(**small, hidden_act="gelu_new"),
        "roberta": RobertaConfig(**small, type_vocab_size=1, pad_token_id=1),
        "distilbert": DistilBertConfig(vocab_size=1200, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                                       max_position_embeddings=80),
    }


@pytest.mark.parametrize("kind", ["bert", "bert_tanh", "roberta", "distilbert"])
def test_random_weight_models_match_transformers(tmp_path, kind):
    from transformers import AutoModel

    torch.manual_seed(abs(hash(kind)) % 1000)
    cfg = _hf_models()[kind]
    model = AutoModel.from_config(cfg).eval()
    with torch.no_grad():  # LayerNorms start at 1/0: perturb them so a wrong mapping shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name or "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    engine = TorchEngine(device="cpu", precision="fp32", max_batch=8)
    engine.load(tmp_path)
    rng = np.random.default_rng()
    lengths = [int(n) for n in rng.integers(3, 60, size=5)]
    ids = np.full((5, max(lengths)), cfg.pad_token_id or 0, dtype=np.int64)
    mask = np.zeros_like(ids)
    for r, n in enumerate(lengths):
        ids[r, :n] = rng.integers(5, 1200, size=n)
        mask[r, :n] = 1
    types = np.zeros_like(ids)
    if kind == "bert":
        types[:, 2:] = mask[:, 2:]  # some segment-B tokens
    with torch.no_grad():
        kw = {} if kind == "distilbert" else {"token_type_ids": torch.from_numpy(types)}
        ref = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), **kw).last_hidden_state
    batch = TokenBatch(ids, mask, types, np.array(lengths), Layout.PADDED)
    got = engine.run(batch)
    m = mask.astype(bool)
    np.testing.assert_allclose(got[m], ref.numpy()[m], rtol=1e-4, atol=1e-4)


def test_unsupported_model_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ConfigError, match="gpt2"):
        read_config(tmp_path)


def test_tensor_parallel_shards_sum_to_the_full_layer(bundled_spec):
    """The layer code takes shards: two halves with a summing reduce equal the whole layer."""
    w = load_weights(bundled_spec.path)
    lw, cfg = w.layers[0], w.config
    x = torch.randn(23, cfg.hidden)
    cu = [0, 9, 23]
    full = layer_reference(x, lw, cu, cfg)
    shards = [shard_layer(lw, cfg.head_dim, r, 2) for r in range(2)]
    # emulate an all-reduce: run each shard's partial projections and sum them
    partial = {}

    def capture(r):
        def red(t):
            partial.setdefault(r, []).append(t)
            return t
        return red

    for r, s in enumerate(shards):
        layer_reference(x, s, cu, cfg, reduce=capture(r))
    attn_sum = partial[0][0] + partial[1][0]
    h = torch.nn.functional.layer_norm(x + attn_sum + lw.bo, (cfg.hidden,), lw.ln1_w, lw.ln1_b, cfg.eps)
    # the FFN half of the check runs on the true h
    ffn = [torch.nn.functional.gelu(torch.nn.functional.linear(h, s.w1, s.b1)) @ s.w2.t() for s in shards]
    out = torch.nn.functional.layer_norm(h + ffn[0] + ffn[1] + lw.b2, (cfg.hidden,), lw.ln2_w, lw.ln2_b, cfg.eps)
    torch.testing.assert_close(out, full, rtol=1e-4, atol=1e-4)


def test_positions_and_buckets():
    np.testing.assert_array_equal(position_ids([2, 3], 0), [0, 1, 0, 1, 2])
    np.testing.assert_array_equal(position_ids([1, 2], 2), [2, 2, 3])
    np.testing.assert_array_equal(position_ids([3], 2), [2, 3, 4])  # one sequence: the short path
    np.testing.assert_array_equal(position_ids(np.array([1]), 0), [0])
    for t in range(1, 5000, 7):
        b = token_bucket(t)
        assert b >= t and (t <= 128 or b <= t * 1.125 + 1)


def test_packed_batch_equals_one_by_one(cpu_engine, tokenizer, sentences):
    items = tokenizer.encode(sentences[:6])
    together = cpu_engine.run(TokenBatch.pack(items))
    alone = np.concatenate([cpu_engine.run(TokenBatch.pack([it])) for it in items])
    np.testing.assert_allclose(together, alone, rtol=1e-4, atol=1e-5)
    assert forward_reference is not None


def test_runtime_builds_a_torch_worker(bundled_spec, reference_embed, sentences):
    """`engine: torch` through the runtime's loader: packed batches end to end."""
    from surge.config import EngineConfig
    from surge.runtime.loader import build_worker
    from surge.types import EmbedOptions

    worker = build_worker(bundled_spec, None, EngineConfig(engine="torch", device="cpu", precision="fp32",
                                                           warmup_shapes=[(2, 16)]))
    assert worker.layout is Layout.PACKED
    texts = sentences[:12]
    got = worker.finish(worker.compute(worker.tokenizer.encode(texts)), EmbedOptions())
    assert cosine_rows(got, reference_embed(texts)).min() >= 0.99999


def test_instances_share_weights_and_the_last_close_frees_them(bundled_spec):
    from surge.engines import shared_weights

    a = TorchEngine(device="cpu", precision="bf16", max_batch=4)
    b = TorchEngine(device="cpu", precision="bf16", max_batch=4)
    a.load(bundled_spec.path)
    b.load(bundled_spec.path)
    assert a.weights is b.weights
    key = shared_weights._weights_key(bundled_spec.path, torch.device("cpu"), torch.bfloat16)
    a.close()
    a.close()  # idempotent: must not drop b's reference
    assert key in shared_weights._WEIGHTS
    out = b.run(random_batch(2, 9, 30522, Layout.PACKED))
    assert out.shape == (18, 384) and np.isfinite(out).all()
    b.close()
    assert key not in shared_weights._WEIGHTS


def test_gelu_epilogue_policy_follows_config_and_precision(bundled_spec):
    """cuBLASLt's tanh-GeLU epilogue: allowed by default in half precision only; exact_gelu forbids it."""
    from surge.config import EngineConfig
    from surge.runtime.loader import make_engine

    assert TorchEngine(device="cpu", precision="fp16").approximate_gelu is True
    assert TorchEngine(device="cpu", precision="bf16").approximate_gelu is True
    assert TorchEngine(device="cpu", precision="fp32").approximate_gelu is False
    exact = make_engine(EngineConfig(engine="torch", precision="bf16", exact_gelu=True), bundled_spec, None)
    default = make_engine(EngineConfig(engine="torch", precision="bf16"), bundled_spec, None)
    try:
        assert exact.approximate_gelu is False and default.approximate_gelu is True
    finally:
        exact.close()
        default.close()


def test_a_lone_sequence_takes_the_short_path_with_the_same_fields_positions_and_refusals(cpu_engine, tokenizer,
                                                                                          sentences):
    """One sequence: TokenBatch.pack keeps its arrays (no join) and position_ids is one range; the fields,
    the positions and the refusals are those of the general path."""
    rng = np.random.default_rng()
    item, other = tokenizer.encode([sentences[int(i)] for i in rng.choice(len(sentences), 2, replace=False)])
    one, two = TokenBatch.pack([item]), TokenBatch.pack([item, other])
    n = len(item)
    np.testing.assert_array_equal(one.input_ids, two.input_ids[:n])
    np.testing.assert_array_equal(one.token_type_ids, two.token_type_ids[:n])
    np.testing.assert_array_equal(one.attention_mask, two.attention_mask[:n])
    assert one.lengths.tolist() == [n] and one.cu_seqlens.tolist() == [0, n] and one.layout is Layout.PACKED
    assert one.input_ids.dtype == two.input_ids.dtype and one.cu_seqlens.dtype == two.cu_seqlens.dtype
    for k in (1, n, 512):
        ids = rng.integers(0, 30522, k)
        got = cpu_engine._inputs(TokenBatch.pack([type(item)(ids, np.zeros(k, np.int64))]))[2]
        off = cpu_engine.config.position_offset
        np.testing.assert_array_equal(got, [off + j for j in range(k)])
        assert got.dtype == np.int64
    np.testing.assert_allclose(cpu_engine.run(one)[0], cpu_engine.run(two)[0], rtol=1e-4, atol=1e-5)
    spoiled = one.input_ids.copy()  # pack of one keeps the item's own array: spoil a copy
    spoiled[0] = 30522
    with pytest.raises(InvalidInput, match="token ids"):
        cpu_engine.run(TokenBatch(spoiled, one.attention_mask, one.token_type_ids, one.lengths, Layout.PACKED,
                                  one.cu_seqlens))
    with pytest.raises(InvalidInput, match="lengths must be"):
        cpu_engine.run(TokenBatch.pack([type(item)(np.ones(513, np.int64), np.zeros(513, np.int64))]))


def test_batch_invariance_is_the_default_and_a_named_shape_picked_mode_turns_it_off():
    from surge.config import EngineConfig
    from surge.engines.torch_gpu import TorchEngine
    from surge.errors import EngineError

    engine = TorchEngine(device="cpu")
    assert engine.batch_invariant and engine.gemm == "invariant"
    assert engine.modes((8, 64, 16)) == ("invariant",)
    picked = TorchEngine(device="cpu", gemm="cublas")
    assert not picked.batch_invariant and picked.gemm == "cublas"
    free = TorchEngine(device="cpu", batch_invariant=False)
    assert free.gemm == "auto" and "cublas" in free.modes((8, 64, 16)) and "invariant" not in free.modes((8, 64, 16))
    with pytest.raises(EngineError, match="batch_invariant=False"):
        TorchEngine(device="cpu", gemm="triton", batch_invariant=True)
    assert EngineConfig().batch_invariant is True


def test_the_loader_hands_batch_invariant_to_the_torch_engine(bundled_spec):
    from surge.config import EngineConfig
    from surge.runtime.loader import make_engine

    for flag in (True, False):
        engine = make_engine(EngineConfig(engine="torch", device="cpu", batch_invariant=flag), bundled_spec, None)
        assert engine.batch_invariant is flag

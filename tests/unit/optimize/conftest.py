"""Small models for the optimizer's tests: a tiny random BERT, and deliberately broken variants."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CACHE_DIR


def make_tiny_bert(out: Path, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4, mutate=None) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    from surge.models import bundled_model_dir

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=2 * hidden, max_position_embeddings=128)
    model = BertModel(cfg).eval()
    if mutate is not None:
        with torch.no_grad():
            mutate(model)
    model.save_pretrained(out)
    shutil.copy(bundled_model_dir() / "tokenizer.json", out / "tokenizer.json")
    return out


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_spec(tiny_bert):
    from surge.models import load_model_spec

    return load_model_spec(tiny_bert)


@pytest.fixture(scope="session")
def tiny_export(tiny_spec) -> Path:
    from surge.optimize.export import ensure_exported

    return ensure_exported(tiny_spec, CACHE_DIR) / "model.onnx"


@pytest.fixture(scope="session")
def bundled_export(bundled_artifact) -> Path:
    return bundled_artifact / "model.onnx"


def feeds_for(spec, texts=None, seed=0, batch=3, seq=19):
    """Real sentences (tokenized, padded) or random ids with ragged masks — never zeros."""
    from surge.runtime.tokenize import Tokenizer
    from surge.types import TokenBatch

    if texts is not None:
        tok = Tokenizer(spec.tokenizer_file, max_length=128, vocab_size=spec.vocab_size)
        b = TokenBatch.pad(tok.encode(texts))
        return {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "token_type_ids": b.token_type_ids}
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, spec.vocab_size, size=(batch, seq), dtype=np.int64)
    mask = np.ones_like(ids)
    for i in range(1, batch):
        mask[i, seq - 3 * i :] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}


def run_onnx(model, feeds) -> np.ndarray:
    import onnxruntime as ort

    src = model if isinstance(model, bytes) else str(model)
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    out = sess.run(None, {k: v for k, v in feeds.items() if k in names})[0].astype(np.float32)
    # Padded positions carry no meaning (and fused attention skips them): compare real tokens.
    return out * feeds["attention_mask"][..., None]


@pytest.fixture(scope="session")
def fused_minilm(bundled_export, bundled_spec):
    """The bundled model's export after `surge optimize`'s graph passes (ONNX proto)."""
    import onnx_ir as ir

    from surge.optimize.passes import PassContext, graph_passes, run_passes

    model = ir.load(str(bundled_export))
    run_passes(model, graph_passes(), PassContext(bundled_spec.num_heads, bundled_spec.hidden_size))
    return ir.serde.serialize_model(model)

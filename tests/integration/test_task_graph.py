"""The exported ONNX graph of a task model keeps its head: logits out ([N, labels], token heads
[N, L, labels]), token_type_ids in for pair models, checked against transformers FP32 on real
sentences; ONNX Runtime serves those logits with no host-side head; the graph kinds of one model
directory (task, backbone, embedding) are cached under different keys."""

from __future__ import annotations

import numpy as np
import pytest

from surge.config import EngineConfig
from surge.models import load_model_spec
from surge.models.finetune import heldout_commands
from surge.optimize.export import ensure_exported
from surge.optimize.validate import session
from tests.conftest import CACHE_DIR
from tests.task_models import task_models_dir


@pytest.fixture(scope="module")
def models():
    return task_models_dir()


def _hf(path, token: bool):
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    transformers.logging.set_verbosity_error()
    cls = AutoModelForTokenClassification if token else AutoModelForSequenceClassification
    return cls.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))


def _feeds(sess, enc):
    names = {i.name for i in sess.get_inputs()}
    return {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids") if k in names}


@pytest.mark.parametrize("name", ["intent", "ce", "slots"])
def test_graph_returns_the_heads_logits(models, sentences, name):
    import torch

    spec = load_model_spec(models / name)
    sess = session(ensure_exported(spec, CACHE_DIR) / "model.onnx", threads=2)
    model, tok = _hf(models / name, token=name == "slots")
    rng = np.random.default_rng()
    picks = [sentences[i] for i in rng.choice(len(sentences), 12, replace=False)] + heldout_commands(4)
    if name == "ce":  # pairs: the document's tokens are segment 1
        assert "token_type_ids" in {i.name for i in sess.get_inputs()}
        enc = tok(picks[:8], picks[8:], padding=True, return_tensors="np")
        assert enc["token_type_ids"].any()
    else:
        enc = tok(picks, padding=True, return_tensors="np")
    (got,) = sess.run(None, _feeds(sess, enc))
    assert sess.get_outputs()[0].name == "logits"
    with torch.inference_mode():
        want = model(**{k: torch.from_numpy(v) for k, v in enc.items()}).logits.numpy()
    n, length = enc["input_ids"].shape
    labels = len(spec.labels)
    assert got.shape == want.shape == ((n, length, labels) if name == "slots" else (n, labels))
    mask = enc["attention_mask"].astype(bool)
    g, w = (got[mask], want[mask]) if name == "slots" else (got, want)
    np.testing.assert_allclose(g, w, atol=2e-4, rtol=1e-4)


def test_ort_engine_serves_the_graphs_logits(models, sentences):
    """The worker takes the engine's rows (no host-side head) and they are transformers' logits."""
    import torch

    from surge.cli.bootstrap import resolve_artifact
    from surge.runtime.loader import build_worker

    spec = load_model_spec(models / "ce")
    cfg = EngineConfig(engine="onnxrt", threads=2)
    w = build_worker(spec, resolve_artifact(spec, cfg, CACHE_DIR), cfg)
    assert w.engine_heads and w.engines.engines[0].logits
    pairs = [(sentences[i], sentences[i + 40]) for i in np.random.default_rng().choice(40, 6, replace=False)]
    rows = w.compute(w.tokenizer.to_encoded(w.tokenizer.encodings(pairs)))
    model, tok = _hf(models / "ce", token=False)
    enc = tok([p[0] for p in pairs], [p[1] for p in pairs], padding=True, return_tensors="pt")
    with torch.inference_mode():
        want = model(**enc).logits.numpy()
    np.testing.assert_allclose(np.asarray(rows, dtype=np.float32), want, atol=2e-4)


def test_graph_kinds_never_share_a_cache_entry(models):
    from surge.errors import ConfigError
    from surge.runtime.loader import build_worker

    intent = load_model_spec(models / "intent")
    as_embed = load_model_spec(models / "intent", task="embed")
    task_dir = ensure_exported(intent, CACHE_DIR)
    backbone_dir = ensure_exported(intent, CACHE_DIR, backbone=True)
    embed_dir = ensure_exported(as_embed, CACHE_DIR)
    assert len({task_dir, backbone_dir, embed_dir}) == 3
    assert [o.name for o in session(backbone_dir / "model.onnx").get_outputs()] == ["last_hidden_state"]
    assert [o.name for o in session(embed_dir / "model.onnx").get_outputs()] == ["last_hidden_state"]
    # two heads on one frozen backbone share its backbone graph, never one another's task graph
    assert ensure_exported(load_model_spec(models / "slots"), CACHE_DIR, backbone=True) == backbone_dir
    assert ensure_exported(load_model_spec(models / "slots"), CACHE_DIR) != task_dir
    # a task graph handed to an embedding model is refused, not pooled
    with pytest.raises(ConfigError, match="logits"):
        build_worker(as_embed, task_dir, EngineConfig(engine="onnxrt", threads=2))

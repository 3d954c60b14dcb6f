"""Task heads on the CPU engines (ONNX Runtime and the torch CPU path) against transformers FP32:
classification logits and pipeline scores, cross-encoder scores, token logits and the
token-classification pipeline's entities, on real sentences; the runtime path (cache,
batcher) for rerank pairs; several heads on one backbone equal to each alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from surge.config import BatchingConfig, EngineConfig, ServerConfig
from surge.models import load_model_spec
from surge.models.finetune import heldout_commands
from tests.conftest import CACHE_DIR
from tests.task_models import task_models_dir

ENGINES = ["onnxrt", "torch"]
ODD = ["Turn on the lights in Zürich's kitchen, please!", "what's the weather in new york tomorrow?",
       "Play Miles Davis... then set a 10-minute timer", "remind me to call Dr. O'Neill at 3:30pm"]


@pytest.fixture(scope="module")
def models():
    return task_models_dir()


@pytest.fixture(scope="module")
def texts(sentences):
    rng = np.random.default_rng()
    picks = [sentences[i] for i in rng.choice(len(sentences), 24, replace=False)]
    return picks + heldout_commands(16) + ODD


_WORKERS: dict = {}


def _worker(path, engine, heads=None, name=None):
    """A worker per (model, engine), built once per module (ONNX sessions and weights are not free)."""
    if heads is None and (path, engine) in _WORKERS:
        return _WORKERS[(path, engine)]
    w = _build_worker(path, engine, heads, name)
    if heads is None:
        _WORKERS[(path, engine)] = w
    return w


def _build_worker(path, engine, heads=None, name=None):
    from surge.cli.bootstrap import resolve_artifact
    from surge.runtime.loader import build_worker

    spec = load_model_spec(path, name=name)
    cfg = EngineConfig(engine=engine, threads=2)
    return build_worker(spec, resolve_artifact(spec, cfg, CACHE_DIR, backbone=bool(heads)), cfg, heads=heads)


def _rows(worker, items, batch=8):
    tok = worker.tokenizer
    out = []
    for i in range(0, len(items), batch):  # mixed-length batches
        encs = tok.encodings(items[i:i + batch])
        rows = worker.compute(tok.to_encoded(encs))
        out += [worker.heads.split(r, worker.heads.first.name, len(e.ids)) for r, e in zip(rows, encs)]
    return out


def _hf(path, kind):
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    transformers.logging.set_verbosity_error()
    cls = AutoModelForTokenClassification if kind == "token" else AutoModelForSequenceClassification
    return cls.from_pretrained(str(path)).eval(), AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", ["cls5", "intent", "multi"])
def test_classifier_logits_match_transformers(models, texts, engine, name):
    import torch

    model, tok = _hf(models / name, "seq")
    with torch.no_grad():
        ref = model(**tok(texts, padding=True, truncation=True, return_tensors="pt")).logits.numpy()
    got = np.stack(_rows(_worker(models / name, engine), texts))
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=2e-4 * max(1.0, np.abs(ref).max()))
    assert (got.argmax(1) == ref.argmax(1)).all()
    if name == "cls5":
        assert len(set(ref.argmax(1))) >= 3  # the random head really separates inputs


def test_pipeline_scores_match(models, texts):
    """Softmax (single label) and sigmoid (multi-label) as transformers' text-classification pipeline."""
    from transformers import pipeline

    from surge.engines.heads import scores

    for name in ("multi",):  # sigmoid per label (softmax: tests/e2e/test_tasks_server.py, InferenceClient)
        w = _worker(models / name, "onnxrt")
        pipe = pipeline("text-classification", model=str(models / name), top_k=None, device="cpu")
        ref = pipe(texts[:12])
        got = _rows(w, texts[:12])
        head = w.heads.first
        for r, g in zip(ref, got):
            want = {d["label"]: d["score"] for d in r}
            have = dict(zip(head.labels, scores(head, g)))
            for label in want:
                assert have[label] == pytest.approx(want[label], abs=1e-4)


@pytest.mark.parametrize("engine", ENGINES)
def test_cross_encoder_scores_match_sentence_transformers(models, sentences, engine):
    from sentence_transformers import CrossEncoder

    from surge.engines.heads import sigmoid

    query = "how do I turn on the lights in the kitchen"
    pairs = [(query, d) for d in sentences[:20] + heldout_commands(10)]
    ce = CrossEncoder(str(models / "ce"), device="cpu")
    ref = np.asarray(ce.predict(pairs), dtype=np.float64)
    w = _worker(models / "ce", engine)
    assert w.task == "rerank"
    got = sigmoid(np.concatenate(_rows(w, pairs)))
    np.testing.assert_allclose(got, ref, atol=2e-5)
    assert np.argsort(-got)[0] == np.argsort(-ref)[0]
    # the pair's second segment really gets token type 1
    e = w.tokenizer.encodings([pairs[0]])[0]
    assert set(e.type_ids) == {0, 1}


@pytest.mark.parametrize("name,engine", [("tok7", "torch"), ("slots", "onnxrt"), ("slots", "torch")])
def test_token_logits_match_transformers(models, texts, engine, name):
    import torch

    model, tok = _hf(models / name, "token")
    w = _worker(models / name, engine)
    got = _rows(w, texts)
    enc = tok(texts, padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits.numpy()
    for g, row, mask in zip(got, logits, enc["attention_mask"].numpy()):
        ref = row[mask.astype(bool)]
        assert g.shape == ref.shape
        np.testing.assert_allclose(g, ref, atol=2e-4 * max(1.0, np.abs(ref).max()))


@pytest.mark.parametrize("strategy,name", [("none", "tok7"), ("simple", "slots"), ("first", "tok7"),
                                           ("average", "slots"), ("max", "tok7"), ("simple", "tok7")])
def test_entities_match_token_classification_pipeline(models, texts, strategy, name):
    from transformers import pipeline

    from surge.runtime.entities import EntityDecoder

    for name in (name,):
        w = _worker(models / name, "onnxrt")
        pipe = pipeline("token-classification", model=str(models / name), aggregation_strategy=strategy,
                        device="cpu")
        dec = EntityDecoder(w.tokenizer.backend)
        sample = texts[-20:]
        encs = w.tokenizer.encodings(sample)
        rows = _rows(w, sample)
        found = 0
        for t, e, logits in zip(sample, encs, rows):
            ref = pipe(t)
            got = dec.entities(t, e, logits, w.heads.first.labels, strategy)
            assert len(got) == len(ref), (t, got, ref)
            for g, r in zip(got, ref):
                key = "entity" if strategy == "none" else "entity_group"
                assert g[key] == r[key] and g["word"] == r["word"], (t, g, r)
                assert (g["start"], g["end"]) == (r["start"], r["end"])
                assert g["score"] == pytest.approx(float(r["score"]), abs=1e-4)
                if strategy == "none":
                    assert g["index"] == r["index"]
            found += len(ref)
        assert found > 0


def test_multi_head_equals_each_alone(models, texts):
    """Intent + slots + embedding on one backbone pass give what each model gives alone."""
    from surge.config import HeadFile
    from surge.models import bundled_model_dir
    from surge.types import EmbedOptions

    heads = [HeadFile(name="intent", task="classify", source=str(models / "intent")),
             HeadFile(name="slots", task="token-classify", source=str(models / "slots")),
             HeadFile(name="embed", task="embed")]
    multi = _worker(bundled_model_dir(), "torch", heads=heads, name="assistant")
    alone = {n: _worker(models / n, "torch") for n in ("intent", "slots")}
    emb = _worker(bundled_model_dir(), "torch")
    tok = multi.tokenizer
    encs = tok.encodings(texts)
    rows = multi.compute(tok.to_encoded(encs))
    for name, w in alone.items():
        ref = _rows(w, texts, batch=len(texts))
        for r, e, want in zip(rows, encs, ref):
            np.testing.assert_allclose(multi.heads.split(r, name, len(e.ids)), want, atol=1e-5)
    vec = multi.finish(rows, EmbedOptions())
    want = emb.finish(emb.compute(tok.to_encoded(encs)), EmbedOptions())
    np.testing.assert_allclose(vec, want, atol=1e-6)


def test_head_with_another_backbone_is_refused(models):
    from surge.config import HeadFile
    from surge.errors import ConfigError

    other = models / "other-backbone"
    if not other.exists():
        from surge.models.build import random_bert_base  # noqa: F401  (a smaller stand-in below)
        import shutil

        import torch
        from safetensors.torch import load_file, save_file

        shutil.copytree(models / "intent", other)
        sd = load_file(str(other / "model.safetensors"))
        k = next(k for k in sd if k.endswith("encoder.layer.5.output.LayerNorm.weight"))
        sd[k] = sd[k] + torch.full_like(sd[k], 1e-3)  # "fine-tuned" backbone
        save_file(sd, str(other / "model.safetensors"), metadata={"format": "pt"})
    from surge.models import bundled_model_dir
    from surge.runtime.loader import build_heads

    with pytest.raises(ConfigError, match="different backbone"):
        build_heads(load_model_spec(bundled_model_dir()), [HeadFile(name="x", task="classify", source=str(other))])


def test_rerank_100_documents_spread_over_batches_in_order(models, sentences):
    """One query with 100 documents through the runtime: several batches (token budget / max batch),
    results in the caller's order, equal to scoring each pair alone; a second call hits the cache."""
    from surge.cli.bootstrap import load_service
    from surge.runtime.tasks import TaskRequest

    config = ServerConfig(cache_dir=CACHE_DIR, engine=EngineConfig(threads=2),
                          batching=BatchingConfig(max_batch_size=32, max_batch_tokens=1024))
    spec = load_model_spec(models / "ce")
    service = load_service(config, spec)
    service.mark_ready()
    query = "what does the interpreter do with a module"
    docs = [sentences[i % len(sentences)] + f" ({i})" for i in range(100)]
    alone = np.concatenate(_rows(service.worker, [(query, d) for d in docs], batch=1))

    async def go():
        first = await service.infer(TaskRequest(pairs=[(query, d) for d in docs]))
        again = await service.infer(TaskRequest(pairs=[(query, d) for d in docs]))
        await service.close()
        return first, again

    first, again = asyncio.run(go())
    batches = list(service.batcher.history)
    assert len(batches) >= 4 and sum(b.size for b in batches) == 100
    np.testing.assert_allclose(np.concatenate(first.outputs), alone, atol=1e-4)
    assert all(again.cached) and not any(first.cached)
    np.testing.assert_array_equal(np.concatenate(again.outputs), np.concatenate(first.outputs))

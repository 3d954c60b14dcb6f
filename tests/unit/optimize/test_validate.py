"""The gate's metrics on known cases, and the classifier-head argmax path."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from surge.optimize.validate import BUDGETS, Budget, SetMetrics, check, retrieval_agreement, top1_agreement
from tests.conftest import CACHE_DIR


def test_top1_agreement_strict_and_with_ties():
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((50, 16))
    assert top1_agreement(ref, ref) == 1.0
    # Swap the two nearest neighbours of a query whose neighbours are a near-tie.
    ref[1] = ref[0] + 1e-3 * rng.standard_normal(16)
    ref[2] = ref[0] + 1e-3 * rng.standard_normal(16)
    cand = ref.copy()
    cand[0] = ref[0] + 5e-3 * (ref[2] - ref[1]) / np.linalg.norm(ref[2] - ref[1])
    sims = ref @ ref.T
    assert top1_agreement(ref, cand) < 1.0 or sims[0, 1] == sims[0, 2]
    assert top1_agreement(ref, cand, tolerance=0.01) == 1.0
    noise = rng.standard_normal(ref.shape) * 10
    assert top1_agreement(ref, noise, tolerance=0.01) < 0.5


def _brute_force_retrieval(ref, cand, folds=3, tolerance=0.0):
    """Per query, loops in float64: the reference definition of queries over disjoint documents."""
    n = len(ref)
    hits = []
    for part in np.array_split(np.arange(n), folds):
        docs = [j for j in range(n) if j not in set(part)]
        for i in part:
            cos = lambda a, b: float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))  # noqa: E731
            r = [cos(ref[i], ref[j]) for j in docs]
            c = [cos(cand[i], cand[j]) for j in docs]
            pick = int(np.argmax(c))
            hits.append(pick == int(np.argmax(r)) if tolerance == 0 else r[pick] >= max(r) - tolerance)
    return np.array(hits)


def test_retrieval_agreement_is_queries_over_disjoint_documents_strict_and_tolerant():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((90, 24))
    ref[30:60] = ref[:30] + 0.3 * rng.standard_normal((30, 24))  # every query has a close document
    ref[60:] = ref[:30] + 0.31 * rng.standard_normal((30, 24))  # ... and a second one: near-ties
    cand = ref + 0.05 * rng.standard_normal(ref.shape)  # a lossy copy flips some of them
    strict, ties = retrieval_agreement(ref, cand), retrieval_agreement(ref, cand, tolerance=0.05)
    np.testing.assert_array_equal(strict, _brute_force_retrieval(ref, cand))
    np.testing.assert_array_equal(ties, _brute_force_retrieval(ref, cand, tolerance=0.05))
    assert strict.shape == (90,) and 0.3 < strict.mean() < 1.0 and ties.mean() > strict.mean()
    assert retrieval_agreement(ref, ref).all()
    # A query may not retrieve itself: with documents = the other folds, identical rows inside one fold never match.
    nan = cand.copy()
    nan[5] = np.nan
    assert not retrieval_agreement(ref, nan)[5]


def test_strict_top1_is_its_own_floor():
    m = SetMetrics(n=2715, mean_cosine=0.999, min_cosine=0.992, max_abs_diff=0.1, top1=0.969, top1_tie=0.999)
    result = check(BUDGETS["int8"], {"heldout": m})
    assert not result.passed and result.failures == ["heldout: top1 0.9690 < 0.98"]  # ties do not rescue it
    m.top1 = 0.981
    assert check(BUDGETS["int8"], {"heldout": m}).passed


def test_check_names_every_failed_metric():
    m = SetMetrics(n=10, mean_cosine=0.95, min_cosine=0.9, max_abs_diff=1.0, top1=0.5, top1_tie=0.7, argmax=float("nan"))
    result = check(Budget(mean_cosine=0.99, top1=0.98, argmax=0.98), {"heldout": m})
    assert not result.passed
    text = " ".join(result.failures)
    assert "heldout: mean_cosine" in text and "top1_tie" in text and "argmax" in text  # NaN fails too


def test_classifier_argmax_agreement(tmp_path, sentences):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from surge.models import bundled_model_dir, load_model_spec
    from surge.optimize.export import ensure_exported
    from surge.optimize.validate import Evaluator

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, num_labels=3)
    BertForSequenceClassification(cfg).eval().save_pretrained(tmp_path)
    shutil.copy(bundled_model_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    spec = load_model_spec(tmp_path)
    source = ensure_exported(spec, CACHE_DIR) / "model.onnx"
    ev = Evaluator(spec, source, sentences[:16], sentences[200:216], threads=2)
    logits = ev.reference["calibration"].logits  # the graph keeps the head: logits out
    assert logits.shape == (16, 3)
    from transformers import AutoTokenizer

    with torch.inference_mode():  # the exported head equals transformers' own classifier
        model = BertForSequenceClassification.from_pretrained(tmp_path).eval()
        enc = AutoTokenizer.from_pretrained(bundled_model_dir())(sentences[:16], padding=True, return_tensors="pt")
        expected = model(**enc).logits.numpy()
    np.testing.assert_allclose(logits, expected, atol=1e-4)
    metrics = ev.metrics(source)
    assert all(m.argmax == 1.0 and m.top1 is None for m in metrics.values())
    assert check(BUDGETS["fp32"], metrics).passed


def test_session_spinning_follows_the_argument_then_the_environment(monkeypatch):
    """The gate's sessions: `spinning` given wins; unset, SURGE_ORT_SPINNING="0" parks the threads."""
    import onnx
    from onnx import TensorProto, helper

    from surge.optimize.validate import session

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    onnx.checker.check_model(model)

    def spins(**kw) -> str:
        opts = session(model, 1, **kw).get_session_options()
        try:
            return opts.get_session_config_entry("session.intra_op.allow_spinning")
        except Exception:  # never set: ONNX Runtime's default, spinning
            return "1"

    monkeypatch.delenv("SURGE_ORT_SPINNING", raising=False)
    assert spins() == "1" and spins(spinning=False) == "0"
    monkeypatch.setenv("SURGE_ORT_SPINNING", "0")
    assert spins() == "0" and spins(spinning=True) == "1"
    x = np.random.default_rng(0).standard_normal(2).astype(np.float32)
    np.testing.assert_array_equal(session(model, 1).run(None, {"x": x})[0], np.maximum(x, 0))


def test_a_multi_label_classifier_is_gated_on_every_label_it_reports(sentences):
    """A multi-label head reports every label whose sigmoid passes 0.5, not just its best one: a candidate
    that keeps each input's best label but turns other labels on or off serves different answers."""
    from surge.models import load_model_spec
    from surge.optimize.export import ensure_exported
    from surge.optimize.validate import BUDGETS, Evaluator, check, compare
    from tests.conftest import CACHE_DIR
    from tests.task_models import task_models_dir

    spec = load_model_spec(task_models_dir() / "multi")
    assert spec.task == "classify" and spec.task_info.multi_label
    ev = Evaluator(spec, ensure_exported(spec, CACHE_DIR) / "model.onnx", sentences[:8], sentences[200:300], threads=2)
    ref = ev.reference["heldout"]
    logits = ref.logits.copy()
    top = logits.argmax(1)
    # every other input whose best label is on (logit > 0.2): its weakest other label switched on or off
    # at 0.1, below the best logit
    rows = np.flatnonzero(logits.max(1) > 0.2)[::2]
    assert len(rows) >= 10
    flip = np.isin(np.arange(len(logits)), rows)
    weakest = np.where(np.arange(logits.shape[1])[None, :] == top[:, None], np.inf, np.abs(logits)).argmin(1)
    logits[rows, weakest[rows]] = -np.sign(logits[rows, weakest[rows]]) * 0.1
    assert (logits.argmax(1) == top).all()  # the best label is unchanged
    cand = dataclasses.replace(ref, embeddings=logits, hidden=[logits], cls=logits, logits=logits)
    m = compare(ref, cand)
    assert m.argmax == pytest.approx(1 - flip.mean())
    assert not check(BUDGETS["fp16"], {"heldout": m}).passed
    assert compare(ref, ref).argmax == 1.0

"""The optimizer on task models: the gate measures what the task means (argmax agreement,
ranking agreement, per-token labels), FP16 / INT8 artifacts pass it, a broken head fails it,
and an optimized classifier artifact serves its head."""

from __future__ import annotations

import numpy as np
import pytest

from surge.models import load_model_spec
from surge.models.finetune import heldout_commands
from surge.optimize.pipeline import OptimizeOptions, optimize
from surge.optimize.validate import Evaluator, ranking_agreement
from tests.conftest import CACHE_DIR
from tests.task_models import task_models_dir

N = 48


@pytest.fixture(scope="module")
def models():
    return task_models_dir()


def _options(sentences, **kw):
    return OptimizeOptions(calibration=sentences[:N], heldout=sentences[200:200 + N], measure_latency=False,
                           threads=2, **kw)


def test_ranking_agreement_metrics():
    ref = np.array([[3.0, 2.0, 1.0, 0.0]])
    assert ranking_agreement(ref, ref) == (1.0, 1.0)
    top1, ndcg = ranking_agreement(ref, ref[:, ::-1])
    assert top1 == 0.0 and 0 < ndcg < 1
    assert ranking_agreement(ref, np.array([[3.0, 3.5, 1.0, 0.0]]))[0] == 0.0


def test_fp16_classifier_meets_the_label_budget_and_serves(tmp_path, models, sentences):
    spec = load_model_spec(models / "intent")
    texts = heldout_commands(N) + sentences[:N]
    opts = OptimizeOptions(calibration=texts[:N], heldout=texts[N:], measure_latency=False, threads=2,
                           precision="fp16")
    result = optimize(spec, tmp_path / "intent-fp16", opts, CACHE_DIR)
    assert result.written and result.gate.passed, result.gate.failures
    for m in result.gate.sets.values():
        assert m.argmax is not None and m.argmax >= 0.998
    # the artifact carries its head and serves it
    from surge.cli.bootstrap import resolve_artifact
    from surge.config import EngineConfig
    from surge.runtime.loader import build_worker

    art = load_model_spec(result.artifact)
    assert art.task == "classify"
    w = build_worker(art, resolve_artifact(art, EngineConfig(), CACHE_DIR), EngineConfig(threads=2))
    ref = build_worker(spec, resolve_artifact(spec, EngineConfig(), CACHE_DIR), EngineConfig(threads=2))
    items = w.tokenizer.to_encoded(w.tokenizer.encodings(heldout_commands(16)))
    assert (w.compute(items).argmax(1) == ref.compute(items).argmax(1)).mean() >= 0.9375


@pytest.mark.parametrize("name,metric,precision", [("ce", "ndcg10", "int8")])
def test_task_gate_metrics(tmp_path, models, sentences, name, metric, precision):
    spec = load_model_spec(models / name)
    # plain dynamic INT8 (no SmoothQuant search, no fallback search): the quick path; the gate decides
    opts = _options(sentences, precision=precision, force=True, smooth_alpha=None, int8_fallback=False)
    result = optimize(spec, tmp_path / f"{name}-{precision}", opts, CACHE_DIR)
    for m in result.gate.sets.values():
        value = getattr(m, metric)
        assert value is not None and 0.8 <= value <= 1.0
    assert result.gate.budget.to_json()[metric] > 0


def test_gate_fails_when_the_logits_are_off(models, sentences):
    """A candidate whose token logits are off changes labels: the task metric catches it."""
    from surge.optimize.export import ensure_exported
    from surge.optimize.validate import compare, session

    spec = load_model_spec(models / "slots")
    src = ensure_exported(spec, CACHE_DIR) / "model.onnx"
    assert [o.name for o in session(src).get_outputs()] == ["logits"]  # the head is in the graph
    ev = Evaluator(spec, src, sentences[:8], sentences[200:216], threads=2)
    ref = ev.reference["heldout"]
    rng = np.random.default_rng()
    noisy = [t + rng.normal(0, 4.0, t.shape).astype(np.float32) for t in ref.logits]
    broken = type(ref)(np.concatenate(noisy), noisy, np.concatenate(noisy), noisy, ref.task)
    assert compare(ref, ref).tokens == 1.0
    assert compare(ref, broken).tokens < 0.9
    inf = [t.copy() for t in ref.logits]
    inf[0][0, 0] = np.inf
    from surge.optimize.validate import BUDGETS, check

    bad = compare(ref, type(ref)(np.concatenate(inf), inf, np.concatenate(inf), inf, ref.task))
    assert not check(BUDGETS["fp32"], {"heldout": bad}).passed

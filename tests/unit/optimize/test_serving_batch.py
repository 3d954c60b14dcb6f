"""optimize/serving_batch.py: the rule that picks an artifact's serving batch size, its measurement on a real
model, the manifest hint, and the cap `surge serve --artifact` applies from it (unless the user set one)."""

from __future__ import annotations

import json

import pytest

from surge.config import BatchingConfig
from surge.optimize.serving_batch import SIZES, choose, measure, serving_hint
from tests.unit.optimize.conftest import make_tiny_bert


@pytest.mark.parametrize("ms, expected", [
    ({4: 1.50, 8: 1.35, 16: 1.40, 32: 2.06, 64: 3.60}, 16),  # 1.40 is within 5% of 1.35: the larger wins
    ({4: 1.50, 8: 1.35, 16: 1.45, 32: 2.06, 64: 3.60}, 8),   # 1.45 is 7.4% slower: not a tie
    ({4: 3.3, 8: 3.2, 16: 2.9, 32: 3.4, 64: 5.5}, 16),
    ({1: 2.0, 2: 2.0}, 2),                                   # an exact tie: the larger
    ({4: 1.0, 64: 0.2}, 64),
])
def test_choose_keeps_the_largest_size_within_the_tolerance_of_the_fastest(ms, expected):
    assert choose(ms) == expected


def test_choose_with_no_measurement_is_an_error():
    with pytest.raises(ValueError):
        choose({})


def test_measure_times_every_size_of_a_real_model_and_applies_the_rule(tmp_path, sentences):
    from surge.models import load_model_spec
    from surge.optimize.export import ensure_exported

    spec = load_model_spec(make_tiny_bert(tmp_path / "tiny", seed=5))
    model = (ensure_exported(spec, tmp_path / "cache") / "model.onnx").read_bytes()
    out = measure(model, spec, sentences[:40], sizes=(1, 2, 4), rounds=2, queries=16)
    ms = {int(k): v for k, v in out["ms_per_query"].items()}
    assert set(ms) == {1, 2, 4} and all(v > 0 for v in ms.values())
    assert out["max_batch_size"] == choose(ms) and out["queries"] == 16 and out["batch_threads"] == 1
    assert "threads" not in out  # serving.threads is the engine layout (optimize/serving_layout.py)
    json.dumps(out)  # goes into the manifest as it is


def test_serving_hint_reads_the_manifest(tmp_path):
    assert serving_hint(None) is None and serving_hint(tmp_path) is None  # no manifest
    (tmp_path / "manifest.json").write_text(json.dumps({"precision": "int8"}))
    assert serving_hint(tmp_path) is None  # an artifact from before the measurement
    (tmp_path / "manifest.json").write_text(json.dumps({"serving": {"max_batch_size": 8}}))
    assert serving_hint(tmp_path) == 8
    (tmp_path / "manifest.json").write_text(json.dumps({"serving": {"max_batch_size": 0}}))
    assert serving_hint(tmp_path) is None
    (tmp_path / "manifest.json").write_text("{not json")
    assert serving_hint(tmp_path) is None


def test_the_artifacts_batch_size_caps_the_batcher_unless_the_user_set_one(tmp_path):
    from surge.cli.bootstrap import _artifact_batch_cap

    (tmp_path / "manifest.json").write_text(json.dumps({"serving": {"max_batch_size": 12}}))
    assert _artifact_batch_cap(BatchingConfig(), tmp_path).max_batch_size == 12
    assert _artifact_batch_cap(BatchingConfig(max_batch_size=3), tmp_path).max_batch_size == 3
    # set explicitly to the default's value: still the user's choice, kept
    assert _artifact_batch_cap(BatchingConfig(max_batch_size=64), tmp_path).max_batch_size == 64
    assert _artifact_batch_cap(BatchingConfig(), None).max_batch_size == BatchingConfig().max_batch_size
    other = _artifact_batch_cap(BatchingConfig(max_batch_tokens=1024), tmp_path)
    assert other.max_batch_size == 12 and other.max_batch_tokens == 1024
    assert max(SIZES) <= BatchingConfig().max_batch_size  # the measured sizes never exceed the default cap

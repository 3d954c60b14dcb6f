"""`surge distill` on task models: the gate measures what the task means (a classifier's labels), so a
student that lost them is not promoted; a head distill cannot train is refused before training."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from surge.cli.main import app
from tests.conftest import CACHE_DIR
from tests.task_models import task_models_dir


def _texts(tmp_path, n=64):
    from surge.data import calibration_queries

    f = tmp_path / "texts.txt"
    f.write_text("\n".join(calibration_queries()[:n]) + "\n", encoding="utf-8")
    return f


def _distill(tmp_path, model, *args):
    return CliRunner().invoke(app, ["distill", str(model), "-o", str(tmp_path / "student"), "--texts", str(_texts(tmp_path)),
                                    "--time-budget", "0", "--batch-size", "16", "--no-latency", "--threads", "2",
                                    "--cache-dir", str(CACHE_DIR), *map(str, args)])


def test_a_classifier_student_is_gated_on_its_labels(tmp_path):
    """A one-layer student of the 6-layer intent classifier after 2 steps: its labels are not the teacher's.
    The gate says so in label agreement (the embedding floors mean nothing on logits) and does not promote it."""
    result = _distill(tmp_path, task_models_dir() / "intent", "--layers", "1", "--steps", "2", "--max-sentences", "64")
    assert result.exit_code == 2, (result.output, result.exception)
    assert "not promoted" in result.output and "argmax" in result.output
    rejected = tmp_path / "student.rejected"
    report = json.loads((rejected / "distill.json").read_text())
    held = report["gate"]["sets"]["heldout"]
    assert held["argmax"] is not None and held["argmax"] < report["gate"]["budget"]["argmax"]
    assert not (tmp_path / "student").exists()


def test_a_token_tagger_is_refused_before_training(tmp_path):
    """Distillation trains a sequence head or embeddings; a token tagger's student would be written without
    its head (an embedding model): refused at once, with the reason."""
    result = _distill(tmp_path, task_models_dir() / "slots", "--layers", "1", "--steps", "2", "--max-sentences", "16")
    assert result.exit_code == 1, (result.output, result.exception)
    assert "token-classify" in result.output
    assert not (tmp_path / "student").exists() and not (tmp_path / "student.staging").exists()

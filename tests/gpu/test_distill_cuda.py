"""`surge distill --device cuda`: the student trains on the GPU and is written as a CPU model directory."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_distill_on_the_gpu_trains_and_writes_a_cpu_student(tmp_path):
    from surge.data import calibration_queries
    from surge.models import load_model_spec
    from surge.optimize.distill import DistillOptions, distill
    from tests.unit.optimize.conftest import make_tiny_bert

    teacher = make_tiny_bert(tmp_path / "teacher", seed=5, layers=4, hidden=64, heads=4)
    spec = load_model_spec(teacher)
    opts = DistillOptions(layers=2, steps=60, time_budget=0, batch_size=16, lr=1e-3, device="cuda",
                          texts=calibration_queries()[:400], bank_weight=0.1)
    result = distill(spec, tmp_path / "student", opts)
    assert result.info["device"].startswith("cuda")
    assert len(result.losses) == 60 and np.all(np.isfinite(result.losses))
    assert np.mean(result.losses[-6:]) < 0.85 * np.mean(result.losses[:6])
    from transformers import AutoModel

    student = AutoModel.from_pretrained(str(tmp_path / "student"), local_files_only=True)
    assert next(student.parameters()).device.type == "cpu" and student.config.num_hidden_layers == 2

"""kind: torch on a CUDA GPU: one CUDA graph per batch bucket, results equal eager PyTorch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from surge.engines.tensor_torch import TorchTensorEngine  # noqa: E402
from tests.tensor.torch_models import export_two_heads  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("pt2") / "model.pt2"
    model = export_two_heads(path, max_batch=64)
    return path, model.cuda()


def eager(model, x):
    with torch.inference_mode():
        return [t.float().cpu().numpy() for t in model(torch.from_numpy(x).cuda())]


def test_one_cuda_graph_per_bucket_and_rows_never_leak(program):
    path, model = program
    engine = TorchTensorEngine(device="cuda")
    engine.load(path)
    engine.warmup(8)
    assert sorted(engine.graphs) == [1, 2, 4, 8]
    rng = np.random.default_rng(9)
    big = rng.standard_normal((8, 3, 16, 16)).astype(np.float32)
    engine.run({"pixels": big})  # fills the bucket's static buffer with other rows
    for n in (1, 3, 5, 8):
        x = rng.standard_normal((n, 3, 16, 16)).astype(np.float32)
        out = engine.run({"pixels": x})
        logits, peak = eager(model, x)
        assert out["output__0"].shape == (n, 4)
        np.testing.assert_allclose(out["output__0"], logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(out["output__1"], peak, rtol=1e-4, atol=1e-4)


def test_fp16_torch_kind_matches_eager_fp32(program):
    """The engine alone: the GPU machine has no pydantic, so the service path is tested on the CPU
    (tests/unit/test_tensor_torch.py), with the same engine behind it."""
    path, model = program
    engine = TorchTensorEngine(device="cuda", precision="fp16")
    engine.load(path)
    engine.warmup(16)
    assert sorted(engine.graphs) == [1, 2, 4, 8, 16]
    rng = np.random.default_rng(10)
    for n in (1, 6, 16):
        x = rng.standard_normal((n, 3, 16, 16)).astype(np.float32)
        out = engine.run({"pixels": x})["output__0"]
        logits, _ = eager(model, x)
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, logits, rtol=2e-2, atol=2e-2)

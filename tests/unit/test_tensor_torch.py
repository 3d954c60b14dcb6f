"""kind: torch on the CPU: a torch.export program served by tensor name, batched by the
batcher; each request's outputs equal eager PyTorch on that request alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from surge.config import BatchingConfig, CacheConfig, EngineConfig  # noqa: E402
from surge.errors import EngineError, InvalidInput  # noqa: E402
from surge.models.tensor_config import TensorModelOptions  # noqa: E402
from surge.runtime.tensor_loader import build_tensor_service  # noqa: E402
from tests.tensor.torch_models import export_two_heads  # noqa: E402


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    path = tmp_path_factory.mktemp("pt2") / "model.pt2"
    return path, export_two_heads(path)


def _service(path, **opts):
    return build_tensor_service("heads", "1", "torch", path, TensorModelOptions(**opts), EngineConfig(),
                                BatchingConfig(max_batch_size=16, max_queue_delay_ms=50), CacheConfig(enabled=False),
                                None)


def test_torch_kind_batches_and_matches_eager_per_request(program):
    path, model = program
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((n, 3, 16, 16)).astype(np.float32) for n in (1, 3, 2, 4)]

    async def run():
        s = _service(path, outputs=[{"name": "logits", "datatype": "FP32", "dims": [4]},
                                    {"name": "peak", "datatype": "FP32", "dims": []}])
        await s.warmup()
        s.mark_ready()
        got = await asyncio.gather(*[s.infer({"pixels": x}) for x in xs])
        with pytest.raises(InvalidInput):
            await s.infer({"pixels": xs[0][:, :, :8]})
        meta = s.config.metadata(["1"])
        sizes = [b.size for b in s.batcher.history]
        await s.close()
        return got, meta, sizes

    got, meta, sizes = asyncio.run(run())
    assert max(sizes) > 1
    assert meta["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 3, 16, 16]}]
    assert [o["name"] for o in meta["outputs"]] == ["logits", "peak"]
    for x, g in zip(xs, got):
        with torch.no_grad():
            logits, peak = model(torch.from_numpy(x))
        np.testing.assert_allclose(g.outputs["logits"], logits.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g.outputs["peak"], peak.numpy(), rtol=1e-5, atol=1e-5)


def test_a_pt2_that_does_not_load_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.pt2"
    bad.write_bytes(b"PK\x03\x04 not really a torch.export archive")
    with pytest.raises(EngineError) as e:
        _service(bad)
    assert "cannot load model.pt2" in e.value.message

"""Tensor models without a server: config.pbtxt parsing, the repository reading it,
batching by shape with per-request results, the tensor cache, the CUDA provider check."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from surge.config import BatchingConfig, CacheConfig, EngineConfig
from surge.errors import ConfigError, InvalidInput
from surge.models.config_pbtxt import load_model_file, model_file_dict, parse_text_proto
from surge.models.tensor_config import TensorModelOptions
from surge.runtime.repository import scan_model
from surge.runtime.tensor_loader import build_tensor_service
from tests.tensor.graphs import embed_onnx, mlp_onnx

PBTXT = """
# a Triton model configuration
name: "resnet"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  {
    name: "pixels"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 32, 32 ]
  }
]
output [ { name: "logits", data_type: TYPE_FP32, dims: [ 10 ] },
         { name: "label" data_type: TYPE_STRING dims: [ 1 ] reshape: { shape: [ ] } } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 300 }
instance_group [ { count: 2 kind: KIND_GPU gpus: [ 1 ] } ]
parameters: { key: "threshold" value: { string_value: "0.5" } }
version_policy: { latest: { num_versions: 2 } }
"""


def test_text_format_parser_reads_triton_syntax():
    cfg = parse_text_proto(PBTXT)
    assert cfg["name"] == "resnet" and cfg["max_batch_size"] == 8
    assert cfg["input"][0]["dims"] == [3, 32, 32] and cfg["input"][0]["data_type"] == "TYPE_FP32"
    assert [o["name"] for o in cfg["output"]] == ["logits", "label"]
    assert cfg["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    assert cfg["version_policy"] == {"latest": {"num_versions": 2}}


def test_config_pbtxt_maps_onto_a_model_file(tmp_path):
    (tmp_path / "config.pbtxt").write_text(PBTXT)
    data, ignored = model_file_dict(tmp_path / "config.pbtxt")
    assert ignored == ["version_policy"]
    mf = load_model_file(tmp_path / "config.pbtxt")
    assert mf.kind == "onnx" and mf.tensor.max_batch_size == 8
    assert [(t.name, t.datatype, t.dims) for t in mf.tensor.outputs] == [("logits", "FP32", [10]),
                                                                        ("label", "BYTES", [])]
    assert mf.batching.enabled and mf.batching.max_queue_delay_ms == pytest.approx(0.3)
    assert mf.engine.instances == 2 and mf.engine.device == "cuda:1"
    assert mf.tensor.parameters == {"threshold": "0.5"}
    assert "version_policy" in mf.description


@pytest.mark.parametrize("bad, message", [
    ('backend: "tensorrt"', "surge serves backend onnxruntime, python or pytorch"),
    ('backend: "python" input [ { name: "x" } ]', "each entry needs name and data_type"),
    ('backend: "python" input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }', "missing ']'"),
    ('backend: "python" input [ { name: "x" data_type: TYPE_COMPLEX dims: [ 4 ] } ]', "unknown datatype"),
])
def test_bad_config_pbtxt_names_the_file(tmp_path, bad, message):
    path = tmp_path / "config.pbtxt"
    path.write_text(bad)
    with pytest.raises(ConfigError) as e:
        load_model_file(path)
    assert message in e.value.message and str(path) in e.value.message


def test_repository_takes_config_pbtxt_in_the_model_or_version_directory(tmp_path):
    for name, where in (("a", "a/config.pbtxt"), ("b", "b/1/config.pbtxt")):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / where).write_text('backend: "onnxruntime" max_batch_size: 4')
    for name in ("a", "b"):
        entry = scan_model(tmp_path, name)
        assert entry.versions["1"].error is None, entry.versions["1"].error
        assert entry.versions["1"].config.kind == "onnx" and entry.versions["1"].config.tensor.max_batch_size == 4


def _service(path: Path, **kw):
    return build_tensor_service(path.stem, "1", "onnx", path, TensorModelOptions(**kw), EngineConfig(threads=1),
                                BatchingConfig(max_batch_size=16, max_queue_delay_ms=50), CacheConfig(), None)


def test_requests_batched_by_shape_each_get_their_own_result_and_a_bad_one_fails_alone(tmp_path):
    path = tmp_path / "embed.onnx"
    embed_onnx(path)
    sess = ort.InferenceSession(str(path))
    rng = np.random.default_rng(3)
    reqs = [rng.integers(0, 10, size=(n, length)).astype(np.int64) for n, length in
            ((1, 3), (2, 3), (1, 5), (3, 5), (2, 3))]
    bad = reqs[3].copy()
    bad[1, 2] = 99  # out of the table: ORT refuses this request

    async def run():
        s = _service(path)
        await s.warmup()
        s.mark_ready()
        got = await asyncio.gather(*[s.infer({"ids": r}) for r in reqs[:3] + [bad] + reqs[4:]],
                                   return_exceptions=True)
        sizes = [b.size for b in s.batcher.history]
        await s.close()
        return got, sizes

    got, sizes = asyncio.run(run())
    assert max(sizes) > 1  # they did share a batch
    for i, (r, g) in enumerate(zip(reqs, got)):
        if i == 3:
            assert isinstance(g, InvalidInput) and "rejected the inputs" in g.message
            continue
        np.testing.assert_allclose(g.outputs["mean"], sess.run(None, {"ids": r})[0], rtol=1e-6)


def test_cache_keys_on_tensor_bytes(tmp_path):
    path = tmp_path / "mlp.onnx"
    mlp_onnx(path)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    bias = np.ones((2, 1), np.int64)

    async def run():
        s = _service(path)
        await s.warmup()
        s.mark_ready()
        a = await s.infer({"x": x, "bias": bias})
        b = await s.infer({"x": x.copy(), "bias": bias.copy()})
        c = await s.infer({"x": x + np.float32(0.5), "bias": bias})
        await s.close()
        return a, b, c

    a, b, c = asyncio.run(run())
    assert a.cached == [False] and b.cached == [True] and c.cached == [False]
    np.testing.assert_array_equal(a.outputs["probs"], b.outputs["probs"])
    assert not np.allclose(a.outputs["probs"], c.outputs["probs"])


def test_declarations_must_agree_with_the_graph(tmp_path):
    path = tmp_path / "mlp.onnx"
    mlp_onnx(path)
    with pytest.raises(ConfigError) as e:
        _service(path, inputs=[{"name": "x", "datatype": "FP32", "dims": [9]}, {"name": "bias", "datatype": "INT64",
                                                                              "dims": [1]}])
    assert "declared FP32 [9] but the graph has FP32 [8]" in e.value.message


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="onnxruntime-gpu installed")
def test_cuda_without_onnxruntime_gpu_is_a_clear_error(tmp_path):
    path = tmp_path / "mlp.onnx"
    mlp_onnx(path)
    with pytest.raises(ConfigError) as e:
        build_tensor_service("m", "1", "onnx", path, TensorModelOptions(), EngineConfig(device="cuda"),
                             BatchingConfig(), CacheConfig(), None)
    assert "onnxruntime-gpu" in e.value.message and "CUDA provider" in e.value.message

"""The optimizer on vision graphs: a small ResNet built in code (random weights, random
BatchNorm statistics) and a small CNN trained here on generated images, so top-1 means
something. Every candidate is compared with ONNX Runtime on the raw export."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from surge.models.vision import SmallCNN, export_onnx, resnet, shapes_dataset, train  # noqa: E402
from surge.optimize.vision import (fold_batchnorm, fuse_conv_add_relu, optimize_vision, run,  # noqa: E402
                                   save_candidate)


def ops(model):
    return collections.Counter(n.op_type for n in model.graph.node)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    torch.set_num_threads(2)
    images, labels = shapes_dataset(1200, size=16, seed=0)
    model = train(SmallCNN(width=8), images, labels, epochs=3)
    path = tmp_path_factory.mktemp("cnn") / "cnn.onnx"
    export_onnx(model, path, 16)
    val_x, val_y = shapes_dataset(400, size=16, seed=1)  # fresh images, never trained on
    return onnx.load(str(path)), model, images, val_x, val_y


def test_small_resnet_folds_and_fuses_to_the_same_outputs(tmp_path):
    model = resnet(layers=(1, 1, 1, 1), width=8, classes=10, seed=3)
    export_onnx(model, tmp_path / "r.onnx", 32)
    raw = onnx.load(str(tmp_path / "r.onnx"))
    x = np.random.default_rng(5).standard_normal((6, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        eager = model(torch.from_numpy(x)).numpy()
    folded, n_folded = fold_batchnorm(raw)
    fused, n_fused = fuse_conv_add_relu(folded)
    assert n_folded == ops(raw)["BatchNormalization"] == 1 + 4 * 3 + 4  # stem, 3 per block, 4 downsamples
    assert ops(folded)["BatchNormalization"] == 0
    # stem conv+relu, per block conv1/conv2 (+relu) and conv3 + add + relu
    assert n_fused == 1 + 4 * 3 and ops(fused)["FusedConv"] == n_fused and ops(fused)["Add"] == 0
    scale = np.abs(eager).max()
    for m in (raw, folded, fused):
        np.testing.assert_allclose(run(m, {"pixels": x}), eager, atol=1e-4 * scale, rtol=1e-4)


def test_every_precision_passes_the_gate_on_the_trained_cnn(trained, tmp_path):
    raw, model, images, val_x, val_y = trained
    with torch.no_grad():
        eager_acc = float((model(torch.from_numpy(val_x)).argmax(1).numpy() == val_y).mean())
    assert eager_acc > 0.85  # the test set is learnable: top-1 means something
    report = optimize_vision(raw, {"pixels": images[:128]}, {"pixels": val_x}, tmp_path, labels=val_y)
    assert report.reference_accuracy == pytest.approx(eager_acc)
    by = {c.name: c for c in report.candidates}
    assert all(c.passed for c in by.values()), [(c.name, c.note) for c in by.values()]
    assert by["fp32"].top1_agreement == 1.0
    assert ops(by["fp32"].model)["FusedConv"] == 3 and ops(by["fp32"].model)["BatchNormalization"] == 0
    assert by["fp16"].top1_agreement >= 0.99 and by["int8"].top1_agreement >= 0.97
    assert ops(by["int8"].model)["QuantizeLinear"] > 0
    assert by["int8"].accuracy >= report.reference_accuracy - 0.02
    # FP16 block list: the blocked op types still compute in FP32
    fp16 = by["fp16"].model
    assert any(t.data_type == onnx.TensorProto.FLOAT16 for t in fp16.graph.initializer)
    # The gated INT8 graph, written as a repository version, serves as kind onnx with the same outputs.
    import asyncio

    from surge.config import BatchingConfig, CacheConfig, EngineConfig, ModelFile, load_yaml_file
    from surge.runtime.tensor_loader import build_tensor_service

    vdir = save_candidate(report, "int8", tmp_path / "repo" / "cnn" / "1")
    mf = load_yaml_file(vdir / "model.yaml", ModelFile)

    async def serve():
        s = build_tensor_service("cnn", "1", mf.kind, vdir / "model.onnx", mf.tensor, EngineConfig(threads=1),
                                 BatchingConfig(), CacheConfig(enabled=False), None)
        await s.warmup()
        s.mark_ready()
        got = (await s.infer({"pixels": val_x[:8]})).outputs["logits"]
        await s.close()
        return got

    np.testing.assert_allclose(asyncio.run(serve()), run(by["int8"].model, {"pixels": val_x[:8]}), rtol=1e-5,
                               atol=1e-5)


def test_the_gate_rejects_a_badly_calibrated_int8(trained, tmp_path):
    raw, _, images, val_x, val_y = trained
    # Calibrating on near-black images clips every real activation: the gate must catch it.
    report = optimize_vision(raw, {"pixels": images[:64] * 1e-3}, {"pixels": val_x}, tmp_path, labels=val_y,
                             precisions=("int8",))
    cand = report.candidates[0]
    assert not cand.passed and cand.top1_agreement < 0.97 and "gate" in cand.note
    assert report.best("int8") is None
    with pytest.raises(ValueError, match="no int8 candidate passed the gate"):
        save_candidate(report, "int8", tmp_path / "never")

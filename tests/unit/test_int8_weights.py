"""engines/int8_weights.py: uint8 weights make ONNX Runtime's integer products exact on every CPU.

References are float64 products of the same integer codes on fresh random full-range inputs.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from surge.engines.int8_weights import prepared, should_widen, u8s8_saturates, widen_int8_weights
from surge.errors import ConfigError

K, N = 96, 80


def _model(nodes, inputs, output, inits) -> onnx.ModelProto:
    g = h.make_graph(nodes, "g", inputs, [output], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])


def _run(model: onnx.ModelProto | bytes | str, feeds):
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def _cases(rng):
    """(name, model, feeds, float64 reference) for the three uint8 x int8 products, full-range codes."""
    a = rng.integers(0, 256, (7, 5, K), dtype=np.uint8)
    w = rng.integers(-128, 128, (K, N), dtype=np.int8)
    a64, w64 = a.astype(np.float64), w.astype(np.float64)
    sa = np.float32(rng.uniform(0.01, 0.03))
    sb = rng.uniform(1e-3, 1e-2, N).astype(np.float32)
    x_in = h.make_tensor_value_info("a", T.UINT8, [7, 5, K])

    zp_w = rng.integers(-20, 20, N, dtype=np.int8)  # per-column weight zero points
    mmi = _model([h.make_node("MatMulInteger", ["a", "w", "azp", "wzp"], ["y"])], [x_in],
                 h.make_tensor_value_info("y", T.INT32, [7, 5, N]),
                 [nh.from_array(w, "w"), nh.from_array(np.array(128, np.uint8), "azp"), nh.from_array(zp_w, "wzp")])
    yield "MatMulInteger", mmi, {"a": a}, (a64 - 128) @ (w64 - zp_w)

    mif = _model([h.make_node("MatMulIntegerToFloat", ["a", "w", "sa", "sb", "azp", "wzp", "bias"], ["y"],
                              domain="com.microsoft")], [x_in], h.make_tensor_value_info("y", T.FLOAT, [7, 5, N]),
                 [nh.from_array(w, "w"), nh.from_array(sa, "sa"), nh.from_array(sb, "sb"),
                  nh.from_array(np.array(128, np.uint8), "azp"), nh.from_array(np.array(0, np.int8), "wzp"),
                  nh.from_array(np.linspace(-1, 1, N).astype(np.float32), "bias")])
    yield "MatMulIntegerToFloat", mif, {"a": a}, ((a64 - 128) @ w64) * float(sa) * sb + np.linspace(-1, 1, N)

    # no weight zero point at all: the widened node gets 128
    mif0 = _model([h.make_node("MatMulIntegerToFloat", ["a", "w", "sa", "sb"], ["y"], domain="com.microsoft")],
                  [x_in], h.make_tensor_value_info("y", T.FLOAT, [7, 5, N]),
                  [nh.from_array(w, "w"), nh.from_array(sa, "sa"), nh.from_array(sb, "sb")])
    yield "MatMulIntegerToFloat, no zero points", mif0, {"a": a}, (a64 @ w64) * float(sa) * sb

    x = rng.standard_normal((7, 5, K)).astype(np.float32)
    dqm = _model([h.make_node("DynamicQuantizeMatMul", ["x", "w", "sb", "wzp"], ["y"], domain="com.microsoft")],
                 [h.make_tensor_value_info("x", T.FLOAT, [7, 5, K])], h.make_tensor_value_info("y", T.FLOAT, [7, 5, N]),
                 [nh.from_array(w, "w"), nh.from_array(sb, "sb"), nh.from_array(np.array(0, np.int8), "wzp")])
    # ORT quantizes x per tensor to uint8 (affine over [min(x, 0), max(x, 0)]); the codes it picks
    # come from its own DynamicQuantizeLinear (an emulation differs on rounding ties), the product
    # of those codes in float64 is the reference
    dq = _model([h.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
                [h.make_tensor_value_info("x", T.FLOAT, [7, 5, K])], h.make_tensor_value_info("y", T.UINT8, [7, 5, K]), [])
    dq.graph.output.extend([h.make_tensor_value_info("s", T.FLOAT, []), h.make_tensor_value_info("z", T.UINT8, [])])
    codes, scale, zp = ort.InferenceSession(dq.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    q, scale, zp = codes.astype(np.float64), float(scale), float(zp)
    yield "DynamicQuantizeMatMul", dqm, {"x": x}, ((q - zp) @ w64) * scale * sb

    # ONNX Runtime's quantize_dynamic form: the activation's zero point is a tensor, not an initializer
    dql = _model([h.make_node("DynamicQuantizeLinear", ["x"], ["q", "qs", "qzp"]),
                  h.make_node("MatMulInteger", ["q", "w", "qzp", "wzp"], ["y"])],
                 [h.make_tensor_value_info("x", T.FLOAT, [7, 5, K])], h.make_tensor_value_info("y", T.INT32, [7, 5, N]),
                 [nh.from_array(w, "w"), nh.from_array(np.array(0, np.int8), "wzp")])
    yield "DynamicQuantizeLinear + MatMulInteger", dql, {"x": x}, (q - zp) @ w64


@pytest.mark.parametrize("index", range(5))
def test_widened_products_are_exact(index):
    name, model, feeds, ref = list(_cases(np.random.default_rng()))[index]
    widened = onnx.ModelProto.FromString(model.SerializeToString())
    assert widen_int8_weights(widened) == 1
    # no int8 weight left; the new weight is the old one + 128 as uint8
    assert all(i.data_type != T.INT8 for i in widened.graph.initializer), name
    w_old = nh.to_array(next(i for i in model.graph.initializer if i.name == "w"))
    w_new = nh.to_array(next(i for i in widened.graph.initializer if i.name == "w/u8"))
    assert w_new.dtype == np.uint8 and np.array_equal(w_new.astype(np.int16) - 128, w_old)
    got = _run(widened, feeds).astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-5 * np.abs(ref).max(), err_msg=name)


def test_widened_qattention_equals_fp32_attention_on_the_same_codes():
    """QAttention (quantize_dynamic's attention): its QKV projection is a u8 x s8 product too. Reference:
    ORT's FP32 Attention on the dequantized input and weights (the same numbers, float arithmetic)."""
    rng = np.random.default_rng()
    hidden, heads, b, s = 64, 4, 3, 11
    a = rng.integers(0, 256, (b, s, hidden), dtype=np.uint8)
    w = rng.integers(-128, 128, (hidden, 3 * hidden), dtype=np.int8)
    bias = rng.standard_normal(3 * hidden).astype(np.float32)
    sa, sw = np.float32(0.02), np.float32(0.003)
    q = _model([h.make_node("QAttention", ["a", "w", "bias", "sa", "sw", "", "azp", "wzp"], ["y"],
                            domain="com.microsoft", num_heads=heads)],
               [h.make_tensor_value_info("a", T.UINT8, [b, s, hidden])], h.make_tensor_value_info("y", T.FLOAT, [b, s, hidden]),
               [nh.from_array(w, "w"), nh.from_array(bias, "bias"), nh.from_array(sa, "sa"), nh.from_array(sw, "sw"),
                nh.from_array(np.array(128, np.uint8), "azp"), nh.from_array(np.array(0, np.int8), "wzp")])
    f = _model([h.make_node("Attention", ["x", "w", "bias"], ["y"], domain="com.microsoft", num_heads=heads)],
               [h.make_tensor_value_info("x", T.FLOAT, [b, s, hidden])], h.make_tensor_value_info("y", T.FLOAT, [b, s, hidden]),
               [nh.from_array(w.astype(np.float32) * sw, "w"), nh.from_array(bias, "bias")])
    ref = _run(f, {"x": (a.astype(np.float32) - 128) * sa})
    assert widen_int8_weights(q) == 1
    np.testing.assert_allclose(_run(q, {"a": a}), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


def test_the_cpu_rule_predicts_whether_int8_weights_are_exact():
    """u8s8_saturates() on this CPU, checked against what ONNX Runtime computes here with the int8
    weights as stored: wrong products where it says saturating, exact ones where it says not."""
    name, model, feeds, ref = list(_cases(np.random.default_rng()))[1]
    err = np.abs(_run(model, feeds) - ref).max() / np.abs(ref).max()
    if u8s8_saturates():
        assert err > 1e-2, f"{name}: int8 weights were expected to saturate on this CPU, relative error {err}"
    else:
        assert err < 1e-5, f"{name}: int8 weights were expected to be exact on this CPU, relative error {err}"


def test_shared_weights_and_zero_points_are_widened_once():
    rng = np.random.default_rng()
    w = rng.integers(-128, 128, (K, N), dtype=np.int8)
    a = rng.integers(0, 256, (3, K), dtype=np.uint8)
    nodes = [h.make_node("MatMulInteger", ["a", "w", "azp", "wzp"], [f"y{i}"]) for i in range(2)]
    nodes.append(h.make_node("Add", ["y0", "y1"], ["y"]))
    model = _model(nodes, [h.make_tensor_value_info("a", T.UINT8, [3, K])], h.make_tensor_value_info("y", T.INT32, [3, N]),
                   [nh.from_array(w, "w"), nh.from_array(np.array(128, np.uint8), "azp"),
                    nh.from_array(np.array(0, np.int8), "wzp")])
    # an old-style graph that also lists its weight among the inputs: that input goes with it
    model.graph.input.append(h.make_tensor_value_info("w", T.INT8, [K, N]))
    assert widen_int8_weights(model) == 2
    assert sorted(i.name for i in model.graph.initializer) == ["azp", "w/u8", "wzp/u8"]
    assert [i.name for i in model.graph.input] == ["a"]
    np.testing.assert_array_equal(_run(model, {"a": a}), 2 * ((a.astype(np.int64) - 128) @ w.astype(np.int64)))


def test_non_constant_or_signed_activation_products_are_left_alone():
    # the weight is a graph input, not an initializer: nothing to rewrite
    model = _model([h.make_node("MatMulInteger", ["a", "w"], ["y"])],
                   [h.make_tensor_value_info("a", T.UINT8, [3, K]), h.make_tensor_value_info("w", T.INT8, [K, N])],
                   h.make_tensor_value_info("y", T.INT32, [3, N]), [])
    assert widen_int8_weights(model) == 0
    # int8 activations (s8 x s8 does not saturate, and s8 x u8 is not a kernel ORT has)
    rng = np.random.default_rng()
    w = rng.integers(-128, 128, (K, N), dtype=np.int8)
    a = rng.integers(-128, 128, (3, K), dtype=np.int8)
    for zp in (True, False):
        signed = _model([h.make_node("MatMulInteger", ["a", "w"] + (["azp"] if zp else []), ["y"])],
                        [h.make_tensor_value_info("a", T.INT8, [3, K])], h.make_tensor_value_info("y", T.INT32, [3, N]),
                        [nh.from_array(w, "w")] + ([nh.from_array(np.array(0, np.int8), "azp")] if zp else []))
        assert widen_int8_weights(signed) == 0
        np.testing.assert_array_equal(_run(signed, {"a": a}), a.astype(np.int64) @ w.astype(np.int64))
    # an FP32 graph passes through prepared() untouched, even when widening is forced
    fp = _model([h.make_node("MatMul", ["x", "w"], ["y"])], [h.make_tensor_value_info("x", T.FLOAT, [3, K])],
                h.make_tensor_value_info("y", T.FLOAT, [3, N]),
                [nh.from_array(np.ones((K, N), np.float32), "w")]).SerializeToString()
    assert prepared(fp) is fp


@pytest.mark.parametrize("machine,flags,expected", [
    ("x86_64", {"avx2", "fma"}, True),                      # AMD Zen 3, Intel Skylake client
    ("x86_64", {"avx2", "avx512f", "avx512bw"}, True),      # Skylake-SP: AVX-512 without VNNI still saturates
    ("x86_64", {"avx2", "avx512f", "avx512_vnni"}, False),  # Cascade Lake and later
    ("x86_64", {"avx2", "avx_vnni"}, False),                # Alder Lake
    ("x86_64", {"amx_int8", "amx_tile"}, False),            # Sapphire Rapids
    ("AMD64", None, True),                                  # flags unreadable: counted as saturating
    ("aarch64", {"asimd"}, False),
    ("arm64", set(), False),
])
def test_which_cpus_saturate(machine, flags, expected, monkeypatch):
    monkeypatch.setattr("surge.engines.int8_weights._cpu_flags", lambda: None)  # only `flags` counts
    assert u8s8_saturates(machine, flags) is expected


def test_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("SURGE_INT8_WEIGHTS", "u8")
    assert should_widen() is True
    monkeypatch.setenv("SURGE_INT8_WEIGHTS", "s8")
    assert should_widen() is False
    monkeypatch.setenv("SURGE_INT8_WEIGHTS", "auto")
    assert should_widen() is u8s8_saturates()
    monkeypatch.setenv("SURGE_INT8_WEIGHTS", "int4")
    with pytest.raises(ConfigError, match="auto, u8 or s8"):
        should_widen()


def _artifact(tmp_path, rng):
    """An artifact the serving engine loads: uint8 codes from the ids, one int8 product, [B, N] out."""
    w = rng.integers(-128, 128, (K, N), dtype=np.int8)
    sb = rng.uniform(1e-3, 1e-2, N).astype(np.float32)
    nodes = [h.make_node("Cast", ["input_ids"], ["a"], to=T.UINT8),
             h.make_node("MatMulIntegerToFloat", ["a", "w", "sa", "sb", "azp", "wzp"], ["sentence_embedding"],
                         domain="com.microsoft")]
    inputs = [h.make_tensor_value_info(n, T.INT64, ["B", K]) for n in ("input_ids", "attention_mask")]
    model = _model(nodes, inputs, h.make_tensor_value_info("sentence_embedding", T.FLOAT, ["B", N]),
                   [nh.from_array(w, "w"), nh.from_array(np.float32(0.02), "sa"), nh.from_array(sb, "sb"),
                    nh.from_array(np.array(128, np.uint8), "azp"), nh.from_array(np.array(0, np.int8), "wzp")])
    onnx.save(model, tmp_path / "model.onnx")
    (tmp_path / "manifest.json").write_text(json.dumps({"model_file": "model.onnx", "max_length": K}))
    return w, sb


@pytest.mark.parametrize("mode", ["auto", "u8"])
def test_the_serving_engine_and_the_gate_run_exact_products(mode, tmp_path, monkeypatch):
    from surge.engines.onnxrt import OnnxRuntimeEngine
    from surge.optimize.validate import session
    from surge.types import TokenBatch

    monkeypatch.setenv("SURGE_INT8_WEIGHTS", mode)
    rng = np.random.default_rng()
    w, sb = _artifact(tmp_path, rng)
    ids = rng.integers(0, 256, (6, K))
    batch = TokenBatch(input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=np.zeros_like(ids),
                       lengths=np.full(6, K))
    ref = ((ids - 128.0) @ w.astype(np.float64)) * 0.02 * sb
    engine = OnnxRuntimeEngine(threads=1)
    engine.load(tmp_path)
    np.testing.assert_allclose(engine.run(batch), ref, rtol=2e-5, atol=1e-5 * np.abs(ref).max())
    gate = session(tmp_path / "model.onnx", threads=1)
    got = gate.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-5 * np.abs(ref).max())

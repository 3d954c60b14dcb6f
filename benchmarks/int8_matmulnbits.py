"""Issue 21, session 12: ONNX Runtime's MatMulNBits (com.microsoft) with 8-bit weights as the INT8 product.

Why look: with accuracy_level 4 MatMulNBits quantizes its input to int8 *inside* the kernel, per row and per
block of K (batch invariant by construction, and a block's own scale contains an outlier channel to its 32-256
neighbours), so one node would replace the per-row chain (ReduceMax, ReduceMin, QuantizeLinear, the outlier
split's Gather and Gemm) that is ~40% of the INT8 artifact's time. This measures, at the bundled MiniLM's
three product shapes and 256 rows, one thread: its speed against an FP32 MatMul of the same (dequantized)
weights, its error, and whether a row's output is the same alone as in the batch; then bits 4 / 8, block
sizes 32-128 and accuracy levels 0 / 4 at [256, 384] x [384, 1536].

    python benchmarks/int8_matmulnbits.py
"""

from __future__ import annotations

import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from onnx import numpy_helper as nh


def nbits_model(w: np.ndarray, bits: int, block: int, accuracy: int):
    """MatMulNBits over W [K, N] quantized per block of K (symmetric codes around the mid level), and W as
    the kernel sees it (dequantized)."""
    k, n = w.shape
    half = 2 ** (bits - 1)
    wt = w.T.reshape(n, k // block, block)
    scale = (np.abs(wt).max(-1, keepdims=True) / (half - 1)).astype(np.float32)
    q = (np.clip(np.round(wt / scale), -half, half - 1).astype(np.int32) + half).astype(np.uint8)
    seen = ((q.astype(np.float32) - half) * scale).reshape(n, k).T
    if bits == 4:
        q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    node = helper.make_node("MatMulNBits", ["X", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=accuracy)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", n])],
                          [nh.from_array(q.reshape(n, k // block, -1), "B"), nh.from_array(scale.reshape(-1), "S")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]), seen


def fp32_model(w: np.ndarray):
    k, n = w.shape
    g = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "g",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", n])], [nh.from_array(w, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def session(model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def median_ms(s, x, rounds=20) -> float:
    s.run(None, {"X": x})
    t = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        s.run(None, {"X": x})
        t.append(time.perf_counter() - t0)
    return float(np.median(t)) * 1e3


def main() -> None:
    rng = np.random.default_rng(0)
    print("| K x N | MatMulNBits 8-bit ms (GMAC/s) | FP32 MatMul ms (GMAC/s) | rel. error | row alone == in batch |")
    print("| --- | ---: | ---: | ---: | --- |")
    for k, n in ((384, 1152), (384, 1536), (1536, 384)):
        w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
        m, seen = nbits_model(w, 8, 32, 4)
        s8, s32 = session(m), session(fp32_model(seen))
        x = rng.standard_normal((256, k)).astype(np.float32)
        x[:, 5] *= 20  # an outlier channel
        y8, y32 = s8.run(None, {"X": x})[0], s32.run(None, {"X": x})[0]
        alone = s8.run(None, {"X": x[:1]})[0]
        t8, t32 = median_ms(s8, x), median_ms(s32, x)
        macs = 256 * k * n / 1e6
        print(f"| {k} x {n} | {t8:.3f} ({macs / t8:.0f}) | {t32:.3f} ({macs / t32:.0f}) | "
              f"{np.abs(y8 - y32).max() / np.abs(y32).max():.4f} | {np.array_equal(alone[0], y8[0])} |")
    k, n = 384, 1536
    x = rng.standard_normal((256, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    print("\n| bits | block | accuracy level | ms | GMAC/s |\n| ---: | ---: | ---: | ---: | ---: |")
    for bits in (4, 8):
        for block in (32, 64, 128):
            for acc in (0, 4):
                t = median_ms(session(nbits_model(w, bits, block, acc)[0]), x)
                print(f"| {bits} | {block} | {acc} | {t:.3f} | {256 * k * n / t / 1e6:.0f} |")


if __name__ == "__main__":
    main()

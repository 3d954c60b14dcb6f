"""Which INT8 product this CPU runs exactly, and at what speed (engines/int8_weights.py).

    PYTHONPATH=src python3 benchmarks/int8_weights.py [--fp32 DIR --int8 DIR] [--json F]

Part 1, kernels (one thread, MiniLM's FFN shape [1024 tokens, 384] x [384, 1536], full-range
random codes): FP32 MatMul; uint8 x int8 MatMulInteger as surge's artifacts store it; the same with
the weights widened to uint8 (what the engines run where the first saturates); uint8 x int8 with
activation codes kept <= 128 (exact everywhere, a 7-bit grid); and ORT's MatMulNBits (8 and 4 bits,
blockwise, accuracy level 4 = int8 compute); PyTorch's `torch._int_mm`. Each: median ms, speed-up over FP32 and the share of
outputs that differ from the float64 product of the same codes.

Part 2, with `--fp32` and `--int8` artifacts: held-out accuracy against FP32 and the engine's time
at 24-query serving batches (`benchmarks/int8_designs.py`'s batches, interleaved rounds) for the
INT8 artifact with its weights as stored (int8) and widened (uint8), and with its activation grid
cut to 7 bits (codes <= 128, the exact-everywhere alternative). Numbers:
docs/benchmarks/optimizer.md, issue 21, session 9.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

M, K, N = 1024, 384, 1536


def _session(model: onnx.ModelProto | bytes, threads: int = 1):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _graph(nodes, inputs, out_type, inits) -> onnx.ModelProto:
    g = h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info("y", out_type, [M, N])], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])


def kernel_cases(rng) -> list[tuple[str, onnx.ModelProto, dict, np.ndarray | None]]:
    """(name, model, feeds, float64 reference of the same codes or None)."""
    a = rng.integers(0, 256, (M, K), dtype=np.uint8)
    a7 = rng.integers(0, 129, (M, K), dtype=np.uint8)  # a 7-bit grid around zero point 64
    w = rng.integers(-127, 128, (K, N), dtype=np.int8)
    wu = (w.astype(np.int16) + 128).astype(np.uint8)
    x = rng.standard_normal((M, K)).astype(np.float32)
    wf = (rng.standard_normal((K, N)) * 0.05).astype(np.float32)
    u8_in = [h.make_tensor_value_info("a", T.UINT8, [M, K])]
    mmi = [h.make_node("MatMulInteger", ["a", "w", "azp", "wzp"], ["y"])]
    cases = [("FP32 MatMul", _graph([h.make_node("MatMul", ["x", "w"], ["y"])], [h.make_tensor_value_info("x", T.FLOAT, [M, K])],
                                    T.FLOAT, [nh.from_array(wf, "w")]), {"x": x}, None)]
    for name, codes, zp, weights, wzp in (
            ("u8 x s8 (int8 weights, as stored)", a, 128, w, np.array(0, np.int8)),
            ("u8 x u8 (weights widened)", a, 128, wu, np.array(128, np.uint8)),
            ("u8 x s8, activation codes <= 128", a7, 64, w, np.array(0, np.int8))):
        model = _graph(mmi, u8_in, T.INT32, [nh.from_array(weights, "w"), nh.from_array(np.array(zp, np.uint8), "azp"),
                                             nh.from_array(wzp, "wzp")])
        ref = (codes.astype(np.float64) - zp) @ (weights.astype(np.float64) - wzp.astype(np.float64))
        cases.append((name, model, {"a": codes}, ref))
    for bits in (8, 4):
        blocks = K // 32
        qmax = 2 ** (bits - 1) - 1
        wb = wf.T.reshape(N, blocks, 32)
        scale = np.abs(wb).max(-1) / qmax
        q = (np.clip(np.round(wb / scale[..., None]), -qmax, qmax) + 2 ** (bits - 1)).astype(np.uint8)
        if bits == 4:
            q = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        node = h.make_node("MatMulNBits", ["x", "b", "s"], ["y"], domain="com.microsoft", K=K, N=N, bits=bits,
                           block_size=32, accuracy_level=4)
        cases.append((f"MatMulNBits {bits}-bit, block 32, int8 compute",
                      _graph([node], [h.make_tensor_value_info("x", T.FLOAT, [M, K])], T.FLOAT,
                             [nh.from_array(q, "b"), nh.from_array(scale.astype(np.float32).reshape(-1), "s")]),
                      {"x": x}, None))
    return cases


def kernels(repeats: int = 15) -> list[dict]:
    rows = []
    for name, model, feeds, ref in kernel_cases(np.random.default_rng(0)):
        sess = _session(model)
        for _ in range(3):
            out = sess.run(None, feeds)[0]
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            sess.run(None, feeds)
            ts.append(time.perf_counter() - t)
        wrong = None if ref is None else float((out.astype(np.float64) != ref).mean())
        rows.append({"kernel": name, "ms": float(np.median(ts) * 1e3), "wrong_share": wrong})
    rows.append(_torch_int_mm(repeats))
    base = rows[0]["ms"]
    for r in rows:
        r["x_fp32"] = base / r["ms"]
    return rows


def _torch_int_mm(repeats: int) -> dict:
    """PyTorch's int8 x int8 -> int32 product (oneDNN), one thread, same shapes and codes' range."""
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(1)
    a = torch.from_numpy(rng.integers(-127, 128, (M, K), dtype=np.int8))
    w = torch.from_numpy(rng.integers(-127, 128, (K, N), dtype=np.int8))
    ref = a.numpy().astype(np.float64) @ w.numpy().astype(np.float64)
    out = torch._int_mm(a, w)
    ts = []
    for _ in range(max(3, repeats // 5)):  # a reference loop on some CPUs: seconds a call
        t = time.perf_counter()
        torch._int_mm(a, w)
        ts.append(time.perf_counter() - t)
    return {"kernel": "torch._int_mm s8 x s8", "ms": float(np.median(ts) * 1e3),
            "wrong_share": float((out.numpy().astype(np.float64) != ref).mean())}


def seven_bit(model_bytes: bytes) -> bytes:
    """The per-row artifact with its activation grid cut to codes <= 128 (signed: zero point 64,
    scale absmax / 64; unsigned GELU inputs: scale max / 128): no u8 x s8 pair can saturate."""
    from surge.optimize.rowquant import _C  # the per-row chain's shared constants

    m = onnx.ModelProto.FromString(model_bytes)
    new = {_C + "inv127": np.array(1 / 64.0, np.float32), _C + "zp": np.array(64, np.uint8),
           _C + "inv255": np.array(1 / 128.0, np.float32)}
    for init in m.graph.initializer:
        if init.name in new:
            init.CopyFrom(nh.from_array(new[init.name], init.name))
    return m.SerializeToString()


def artifacts(fp32: Path, int8: Path, rounds: int) -> dict:
    from int8_designs import interleaved, serving_batches  # this script's folder is on sys.path

    from surge.data import calibration_queries, heldout_queries
    from surge.models import load_model_spec
    from surge.optimize.validate import Evaluator, session

    spec = load_model_spec(fp32)
    fp32_bytes = (fp32 / "model.onnx").read_bytes()
    int8_bytes = (int8 / "model.onnx").read_bytes()
    variants = {"FP32": (fp32_bytes, "s8"), "INT8 weights widened to uint8": (int8_bytes, "u8"),
                "INT8 int8 weights as stored": (int8_bytes, "s8"), "INT8 7-bit activation grid": (seven_bit(int8_bytes), "s8")}
    ev = Evaluator(spec, fp32_bytes, calibration_queries(), heldout_queries(), threads=1)
    out: dict = {"variants": {}}
    batches = serving_batches(spec, heldout_queries(), 24, 20)
    runners = {}
    for name, (model, mode) in variants.items():
        os.environ["SURGE_INT8_WEIGHTS"] = mode  # read when each session is made
        if name != "FP32":
            m = ev.metrics(model, sets=("heldout",))["heldout"]
            out["variants"][name] = {"mean_cosine": m.mean_cosine, "min_cosine": m.min_cosine, "top1": m.top1,
                                     "top1_ci95": list(m.top1_ci95)}
        else:
            out["variants"][name] = {}
        sess = session(model, 1, spinning=False)
        keep = {i.name for i in sess.get_inputs()}
        feeds = [{k: v for k, v in b.items() if k in keep} for b in batches]
        sess.run(None, feeds[0])
        runners[name] = (sess, feeds)
    os.environ.pop("SURGE_INT8_WEIGHTS", None)
    times = interleaved(runners, rounds)
    for name, t in times.items():
        out["variants"][name].update(ms_per_batch=t * 1e3, x_fp32=times["FP32"] / t)
    return out


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    from surge.engines.int8_weights import _cpu_flags, u8s8_saturates

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fp32", type=Path)
    p.add_argument("--int8", type=Path)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    console = Console(width=150)
    flags = _cpu_flags() or set()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?") \
        if Path("/proc/cpuinfo").exists() else "?"
    result = {"cpu": cpu, "int8_flags": sorted(flags & {"avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"}),
              "u8s8_saturates": u8s8_saturates(), "onnxruntime": ort.__version__}
    console.print(f"CPU {cpu}; flags {result['int8_flags']}; u8 x s8 saturates here: {result['u8s8_saturates']}")
    result["kernels"] = kernels()
    table = Table(title=f"one thread, [{M}, {K}] x [{K}, {N}]")
    for col in ("kernel", "ms (median)", "x FP32", "outputs wrong"):
        table.add_column(col, justify="left" if col == "kernel" else "right")
    for r in result["kernels"]:
        table.add_row(r["kernel"], f"{r['ms']:.2f}", f"{r['x_fp32']:.2f}x",
                      "-" if r["wrong_share"] is None else f"{r['wrong_share']:.1%}")
    console.print(table)
    if a.fp32 and a.int8:
        sys.path.insert(0, str(Path(__file__).parent))
        console.print("artifacts: held-out accuracy and engine time at 24-query batches ...")
        result["artifacts"] = artifacts(a.fp32, a.int8, a.rounds)
        table = Table(title="the INT8 artifact's encodings against FP32 (held-out queries; 1 thread)")
        for col in ("variant", "mean cos", "min cos", "strict top-1 [95% CI]", "ms a batch", "x FP32"):
            table.add_column(col, justify="left" if col == "variant" else "right")
        for name, r in result["artifacts"]["variants"].items():
            acc = [f"{r['mean_cosine']:.5f}", f"{r['min_cosine']:.4f}",
                   f"{r['top1']:.4f} [{r['top1_ci95'][0]:.3f}, {r['top1_ci95'][1]:.3f}]"] if "top1" in r else ["-"] * 3
            table.add_row(name, *acc, f"{r['ms_per_batch']:.2f}", f"{r['x_fp32']:.2f}x")
        console.print(table)
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

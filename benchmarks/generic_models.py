"""Any-model serving (issue 19): ResNet-50 and the python backend, surge against its baseline in one run.

CPU (default):
  ResNet-50 (built in code, seeded random weights) at batch 1 and 32: plain
  ONNX Runtime on the raw export (BatchNorm kept, ORT's default graph
  optimizations) against surge's optimized FP32 (BatchNorm folded, Conv+Add+ReLU
  fused) and static INT8 (QDQ, calibrated on sample images); same process, same
  threads, interleaved runs; images/s from the median latency. The INT8 row
  also gives its top-1 agreement with FP32 on 64 random images.
  Python backend: per-request latency of a `kind: python` model through surge's
  TensorModelService (batcher + worker process) against calling the same
  execute() in process.

GPU (--gpu): ResNet-50 FP16 as `kind: torch` (torch.export program, CUDA graph
per batch bucket) against eager PyTorch FP16, batch 1 and 32.

    python benchmarks/generic_models.py [--threads 2] [--out results.json]
    python benchmarks/generic_models.py --gpu [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

from surge.bench.timing import cpu_name, wall_ms


def _row(rows, name, batch, ms, **extra):
    med = float(np.median(ms))
    rows.append({"variant": name, "batch": batch, "median_ms": round(med, 3),
                 "p90_ms": round(float(np.percentile(ms, 90)), 3), "images_per_s": round(batch * 1e3 / med, 1),
                 **extra})


def cpu_resnet(threads: int, iters1: int, iters32: int, work: Path, layers=(3, 4, 6, 3), size: int = 224,
               calib_n: int = 16) -> list[dict]:
    import onnx
    import onnxruntime as ort
    import torch

    from surge.models.vision import export_onnx, resnet
    from surge.optimize.vision import fold_batchnorm, fuse_conv_add_relu, quantize_int8

    torch.set_num_threads(threads)
    t = time.time()
    export_onnx(resnet(layers, 64, 1000, seed=0), work / "raw.onnx", size)
    raw = onnx.load(str(work / "raw.onnx"))
    print(f"export {time.time() - t:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    folded, n_fold = fold_batchnorm(raw)
    fused, n_fuse = fuse_conv_add_relu(folded)
    calib = {"pixels": rng.standard_normal((calib_n, 3, size, size)).astype(np.float32)}
    t = time.time()
    int8 = quantize_int8(folded, calib, work / "q", batch=8)
    print(f"folded {n_fold}, fused {n_fuse}; int8 calibration {time.time() - t:.1f} s", flush=True)

    def session(model):
        o = ort.SessionOptions()
        o.intra_op_num_threads = threads
        o.inter_op_num_threads = 1
        return ort.InferenceSession(model.SerializeToString(), o, providers=["CPUExecutionProvider"])

    sessions = {"ORT on the raw export (baseline)": session(raw), "surge optimized FP32": session(fused),
                "surge INT8 (static QDQ)": session(int8)}
    check = rng.standard_normal((64, 3, size, size)).astype(np.float32)
    ref = np.concatenate([sessions["ORT on the raw export (baseline)"].run(None, {"pixels": check[i:i + 16]})[0]
                          for i in range(0, 64, 16)])
    rows = []
    for batch, iters in ((1, iters1), (32, iters32)):
        x = rng.standard_normal((batch, 3, size, size)).astype(np.float32)
        times = {k: [] for k in sessions}
        for s in sessions.values():  # warm-up at this batch size
            s.run(None, {"pixels": x})
        for _ in range(iters):  # interleaved: machine noise hits every variant alike
            for k, s in sessions.items():
                times[k].append(wall_ms(lambda s=s: s.run(None, {"pixels": x}), 1, warmup=0)[0])
        for k in sessions:
            extra = {}
            if batch == 1:
                out = np.concatenate([sessions[k].run(None, {"pixels": check[i:i + 16]})[0] for i in range(0, 64, 16)])
                extra["top1_agreement"] = float((out.argmax(1) == ref.argmax(1)).mean())
                extra["max_abs_diff"] = float(np.abs(out - ref).max())
            _row(rows, k, batch, np.array(times[k]), **extra)
    base = {r["batch"]: r["median_ms"] for r in rows if r["variant"].startswith("ORT")}
    for r in rows:
        r["speedup_vs_baseline"] = round(base[r["batch"]] / r["median_ms"], 2)
    return rows


PY_MODEL = '''
import numpy as np


class TritonPythonModel:
    def execute(self, requests):
        return [{"y": (r.input("x") * 2 + 1).astype(np.float32)} for r in requests]
'''


def python_overhead(iters: int, work: Path) -> list[dict]:
    import importlib.util

    from surge.config import BatchingConfig, EngineConfig
    from surge.models.python_backend import InferenceRequest
    from surge.models.tensor_config import TensorModelOptions
    from surge.runtime.tensor_loader import build_tensor_service

    path = work / "model.py"
    path.write_text(textwrap.dedent(PY_MODEL))
    spec = importlib.util.spec_from_file_location("bench_py_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = mod.TritonPythonModel()
    x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
    direct = wall_ms(lambda: model.execute([InferenceRequest({"x": x})]), iters)
    opts = TensorModelOptions(inputs=[{"name": "x", "datatype": "FP32", "dims": [16]}],
                              outputs=[{"name": "y", "datatype": "FP32", "dims": [16]}], max_batch_size=8)

    async def served() -> np.ndarray:
        s = build_tensor_service("py", "1", "python", path, opts, EngineConfig(),
                                 BatchingConfig(max_batch_size=8, max_queue_delay_ms=0), None, None)
        await s.warmup()
        s.mark_ready()
        for _ in range(20):
            await s.infer({"x": x})
        times = np.empty(iters)
        for i in range(iters):
            t0 = time.perf_counter()
            await s.infer({"x": x})
            times[i] = time.perf_counter() - t0
        await s.close()
        return times * 1e3

    via = asyncio.run(served())
    rows = []
    _row(rows, "python model: execute() called in process", 1, direct)
    _row(rows, "python model: through surge (batcher + worker process)", 1, via)
    rows[-1]["overhead_us"] = round((np.median(via) - np.median(direct)) * 1e3, 1)
    return rows


def gpu_resnet(iters1: int, iters32: int, work: Path) -> list[dict]:
    import torch
    from torch.export import Dim

    from surge.engines.tensor_torch import TorchTensorEngine
    from surge.models.vision import resnet50

    model = resnet50(seed=0)
    t = time.time()
    program = torch.export.export(model, (torch.randn(2, 3, 224, 224),),
                                  dynamic_shapes={"pixels": {0: Dim("batch", min=1, max=32)}})
    torch.export.save(program, str(work / "resnet50.pt2"))
    print(f"torch.export {time.time() - t:.1f} s", flush=True)
    engine = TorchTensorEngine(device="cuda", precision="fp16")
    engine.load(work / "resnet50.pt2")
    engine.warmup(32)  # CUDA graphs for buckets 1, 2, 4, 8, 16, 32
    eager = model.half().cuda()
    rng = np.random.default_rng(2)
    rows = []
    for batch, iters in ((1, iters1), (32, iters32)):
        x = rng.standard_normal((batch, 3, 224, 224)).astype(np.float32)

        def run_eager():
            with torch.inference_mode():
                out = eager(torch.from_numpy(x).cuda().half())
                return out.float().cpu().numpy()

        def run_surge():
            return engine.run({"pixels": x})["output__0"]

        diff = float(np.abs(run_eager() - run_surge()).max())
        te, ts = [], []
        for _ in range(iters):
            te.append(wall_ms(run_eager, 1, warmup=0)[0])
            ts.append(wall_ms(run_surge, 1, warmup=0)[0])
        _row(rows, "eager PyTorch FP16 (baseline)", batch, np.array(te))
        _row(rows, "surge kind torch FP16 (CUDA graphs)", batch, np.array(ts), max_abs_diff_vs_eager=diff)
        rows[-1]["speedup_vs_baseline"] = round(rows[-2]["median_ms"] / rows[-1]["median_ms"], 2)
    return rows


def table(rows: list[dict]) -> str:
    keys = ["variant", "batch", "median_ms", "p90_ms", "images_per_s", "speedup_vs_baseline", "top1_agreement",
            "overhead_us"]
    keys = [k for k in keys if any(k in r for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--iters1", type=int, default=30)
    ap.add_argument("--iters32", type=int, default=5)
    ap.add_argument("--py-iters", type=int, default=500)
    ap.add_argument("--skip-python", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--layers", default="3,4,6,3", help="ResNet blocks per stage (3,4,6,3: ResNet-50)")
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(), "threads": args.threads,
              "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.gpu:
            import torch

            result["gpu"] = torch.cuda.get_device_name(0)
            result["resnet50_gpu"] = gpu_resnet(args.iters1 * 3, args.iters32 * 4, work)
            print(table(result["resnet50_gpu"]), flush=True)
        else:
            layers = tuple(int(v) for v in args.layers.split(","))
            result["resnet_layers"], result["image_size"] = list(layers), args.size
            result["resnet50_cpu"] = cpu_resnet(args.threads, args.iters1, args.iters32, work, layers, args.size)
            print(table(result["resnet50_cpu"]), flush=True)
        if not args.skip_python:
            result["python_backend"] = python_overhead(args.py_iters, work)
            print(table(result["python_backend"]), flush=True)
    result["load_average_after"] = os.getloadavg()
    print(f"load average before {result['load_average']}, after {result['load_average_after']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

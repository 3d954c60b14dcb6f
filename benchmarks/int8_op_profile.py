"""Where an ONNX artifact's time goes, by operator: FP32 against INT8 at one serving batch shape.

    PYTHONPATH=src python3 benchmarks/int8_op_profile.py --fp32 DIR --int8 DIR [--batch 24] [--runs 40]

ONNX Runtime's own profiler (enable_profiling), two intra-op threads without spinning as the serving
engine runs (engines/onnxrt.py), held-out queries (surge.data) as the batch; prints each artifact's
wall time a run and its operators' share. Numbers: docs/benchmarks/optimizer.md, issue 21, session 6.
"""

from __future__ import annotations

import argparse
import collections
import json
import time

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from surge.data import heldout_queries


def profile(model_dir: str, ids: np.ndarray, mask: np.ndarray, runs: int, threads: int) -> tuple[float, dict]:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.profile_file_prefix = "/tmp/surge_op_profile"
    s = ort.InferenceSession(model_dir if model_dir.endswith(".onnx") else f"{model_dir}/model.onnx", so, providers=["CPUExecutionProvider"])
    feeds = {i.name: (ids if "input_ids" in i.name else mask if "mask" in i.name else np.zeros_like(ids))
             for i in s.get_inputs()}
    warm = 5
    for _ in range(warm):
        s.run(None, feeds)
    t = time.perf_counter()
    for _ in range(runs):
        s.run(None, feeds)
    wall = (time.perf_counter() - t) / runs
    by: collections.Counter = collections.Counter()
    for e in json.load(open(s.end_profiling())):
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by[e["args"]["op_name"]] += e["dur"]
    return wall, {op: d / (warm + runs) / 1e3 for op, d in by.items()}  # ms a run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fp32", required=True)
    p.add_argument("--int8", required=True)
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--runs", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    tok = Tokenizer.from_file(f"{a.fp32}/tokenizer.json")
    tok.no_padding()
    tok.enable_truncation(256)
    encs = tok.encode_batch(heldout_queries()[:a.batch])
    length = max(len(e.ids) for e in encs)
    ids = np.zeros((len(encs), length), np.int64)
    mask = np.zeros_like(ids)
    for i, e in enumerate(encs):
        ids[i, :len(e.ids)] = e.ids
        mask[i, :len(e.ids)] = 1
    walls = {}
    for name, d in (("fp32", a.fp32), ("int8", a.int8)):
        wall, ops = profile(d, ids, mask, a.runs, a.threads)
        walls[name] = wall
        total = sum(ops.values())
        print(f"\n{name}: batch {len(encs)} x {length}, {wall * 1e3:.2f} ms a run (operators {total:.2f} ms)")
        print("| operator | ms a run | share |\n|---|---:|---:|")
        for op, ms in sorted(ops.items(), key=lambda kv: -kv[1])[:14]:
            print(f"| {op} | {ms:.3f} | {100 * ms / total:.1f}% |")
    print(f"\nFP32 / INT8 wall time a run: {walls['fp32'] / walls['int8']:.2f}x")


if __name__ == "__main__":
    main()

"""Latency of the FP32 source and the optimized model on ONNX Runtime CPU, same run, same inputs."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from surge.engines.base import random_batch
from surge.models.hf import ModelSpec

SHAPES = ((1, 32), (8, 64))


def _median_ms(sess, feeds: dict, runs: int) -> float:
    names = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    sess.run(None, feeds)  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1000)


def compare_latency(source: Path | bytes, optimized: Path | bytes, spec: ModelSpec, threads: int = 0,
                    shapes=SHAPES, runs: int = 10, disabled_optimizers: list[str] | tuple = ()) -> dict:
    from surge.optimize.validate import session

    src, opt = session(source, threads), session(optimized, threads, disabled_optimizers)
    rows = []
    for batch, seq in shapes:
        b = random_batch(batch, seq, min(spec.vocab_size, 30522))
        feeds = {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "token_type_ids": b.token_type_ids}
        n = max(3, runs if batch * seq <= 256 else runs // 3)
        s_ms, o_ms = _median_ms(src, feeds, n), _median_ms(opt, feeds, n)
        rows.append({"batch": batch, "seq": seq, "source_ms": round(s_ms, 3), "optimized_ms": round(o_ms, 3),
                     "speedup": round(s_ms / o_ms, 2)})
    return {"measured": True, "engine": "onnxruntime-cpu", "threads": threads or "all", "runs": runs,
            "statistic": "median", "rows": rows}

"""GPTQ's rounding (optimize/gptq.py) with numpy's BLAS at its default thread count against one thread, at MiniLM's
shapes (K x N), alternating, seconds a call (median of 7 calls each, after one of each):

    PYTHONPATH=src python3 benchmarks/gptq_blas_threads.py

`gptq_int8` runs on one thread since session 50 (surge/blas_threads.py); this times its body, `_gptq_int8`, both
ways. Numbers: docs/benchmarks/optimizer.md, session 50.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from scipy.linalg import lapack  # noqa: F401  (its BLAS loaded before the controller looks for libraries)
from threadpoolctl import ThreadpoolController

from surge.optimize.gptq import _gptq_int8


def main() -> None:
    rng = np.random.default_rng(0)
    tc = ThreadpoolController()
    print("| K x N | default threads | one thread | one thread's speedup |\n| --- | ---: | ---: | ---: |")
    for k, n in ((384, 384), (384, 1536), (1536, 384)):
        x = rng.standard_normal((4096, k))
        h = x.T @ x / len(x)
        w = rng.standard_normal((k, n)) * 0.05
        res: dict[str, list[float]] = {"default": [], "one": []}
        for mode in ("default", "one") * 8:
            t = time.perf_counter()
            if mode == "one":
                with tc.limit(limits=1, user_api="blas"):
                    _gptq_int8(w, h, 0.01, 128)
            else:
                _gptq_int8(w, h, 0.01, 128)
            res[mode].append(time.perf_counter() - t)
        d, o = (statistics.median(res[m][1:]) for m in ("default", "one"))
        print(f"| {k} x {n} | {d:.3f} | {o:.3f} | {d / o:.2f}x |")


if __name__ == "__main__":
    main()

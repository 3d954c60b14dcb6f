"""GPTQ's rounding (optimize/gptq.gptq_int8) with numpy's BLAS at its default threads against one thread, at MiniLM's
shapes (K x N: 384 x 384, 384 x 1536, 1536 x 384), alternating, seconds a call:

    PYTHONPATH=src python3 benchmarks/gptq_blas_threads.py

Since session 50 gptq_int8 itself runs on one thread, so the "default" rows here time the same thing unless the
limit is taken out (surge/blas_threads.py); the session's numbers before the change are in docs/benchmarks/optimizer.md.
"""
import time, numpy as np
from threadpoolctl import ThreadpoolController
from surge.optimize.gptq import gptq_int8
rng = np.random.default_rng(0)
tc = ThreadpoolController()
for k, n in ((384, 384), (384, 1536), (1536, 384)):
    x = rng.standard_normal((4096, k))
    h = x.T @ x / len(x)
    w = rng.standard_normal((k, n)) * 0.05
    res = {}
    for mode in ("default", "one", "default", "one"):
        t = time.perf_counter()
        if mode == "one":
            with tc.limit(limits=1, user_api="blas"):
                gptq_int8(w, h)
        else:
            gptq_int8(w, h)
        res.setdefault(mode, []).append(time.perf_counter() - t)
    print(k, n, {m: [round(v, 3) for v in vs] for m, vs in res.items()})

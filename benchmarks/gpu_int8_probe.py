"""Is torch._int_mm (INT8 tensor cores, INT32 out) as fast as FP8 `_scaled_mm` (row-wise scales) and BF16 F.linear?

    python3 benchmarks/gpu_int8_probe.py

Per GEMM shape (Llama-3-8B's gate/up, down, qkv; Qwen2-0.5B's gate/up, down) at 32-8192 rows, us a call (CUDA
graphs of 50 calls, median of 7), the three forms side by side in one run; then each form's host time a call
(no graph). Random operands: a speed probe, no outputs compared (session 39: whether a GPU W8A8 INT8 path would pay).
"""
import torch, statistics
dev = "cuda"
def t(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    ts = []
    for _ in range(7):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record(); g.replay(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) * 1e3 / n)
    return statistics.median(ts)
for (N, K) in [(28672, 4096), (4096, 14336), (6144, 4096), (9728, 896), (896, 4864)]:
    wb = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    wi = torch.randint(-127, 127, (N, K), device=dev, dtype=torch.int8)
    wf = wb.to(torch.float8_e4m3fn)
    sw = torch.rand(1, N, device=dev)
    for M in (32, 64, 128, 256, 8192):
        xb = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        xi = torch.randint(-127, 127, (M, K), device=dev, dtype=torch.int8)
        xf = xb.to(torch.float8_e4m3fn); sx = torch.rand(M, 1, device=dev)
        r = {"bf16": t(lambda: torch.nn.functional.linear(xb, wb)),
             "int_mm": t(lambda: torch._int_mm(xi, wi.t())),
             "scaled_mm": t(lambda: torch._scaled_mm(xf, wf.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))}
        print(f"N={N} K={K} M={M}: " + ", ".join(f"{k} {v:.1f} us" for k, v in r.items()), flush=True)
# host cost per call (no graph), M = 8192, N = 9728, K = 896
import time
xf = torch.randn(8192, 896, device=dev).to(torch.float8_e4m3fn); wf = torch.randn(9728, 896, device=dev).to(torch.float8_e4m3fn)
sx = torch.rand(8192, 1, device=dev); sw = torch.rand(1, 9728, device=dev)
xb = torch.randn(8192, 896, device=dev, dtype=torch.bfloat16); wb = torch.randn(9728, 896, device=dev, dtype=torch.bfloat16)
for name, fn in [("scaled_mm", lambda: torch._scaled_mm(xf, wf.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)),
                 ("linear", lambda: torch.nn.functional.linear(xb, wb)), ("empty", lambda: torch.empty(8192, 896, device=dev))]:
    for _ in range(3): fn()
    torch.cuda.synchronize()
    hs = []
    for _ in range(20):
        torch.cuda.synchronize(); a = time.perf_counter(); fn(); hs.append((time.perf_counter() - a) * 1e6)
    print(f"host us a call, {name}: median {statistics.median(hs):.1f}", flush=True)

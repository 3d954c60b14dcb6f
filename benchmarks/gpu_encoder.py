"""BERT-base (random weights) on one GPU: transformers baselines against surge's engine.

Model-only times with CUDA events (median of many), same process, same inputs:
  HF eager FP32, HF SDPA FP16, HF SDPA FP16 replayed from a CUDA graph,
  torch.compile (optional, slow to compile), surge (graph replay per bucket).
Workloads: batch 1 x 32, batch 128 x 32, batch 64 with lengths uniform in
8..128 (HF padded to 128, surge packed), and 1/4/8 surge instances on their
own streams (end-to-end engine.run, threads).

    PYTHONPATH=src python3 benchmarks/gpu_encoder.py --out results.json [--compile max-autotune]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from surge.engines.torch_gpu import TorchEngine
from surge.types import Encoded, TokenBatch

H, I, LAYERS, VOCAB = 768, 3072, 12, 30522


def cuda_time(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median ms of fn() over iters, each timed with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def floors(tokens: int, seqs_len: list[int], peak_tflops: float, bw_tbs: float) -> dict:
    gemm = 2 * tokens * LAYERS * (4 * H * H + 2 * H * I)
    attn = sum(4 * n * n * H for n in seqs_len) * LAYERS
    weight_bytes = 2 * LAYERS * (4 * H * H + 2 * H * I)
    act_bytes = 2 * tokens * LAYERS * (H * 3 + H + H * 2 + I * 2 + H * 4)  # each kernel's reads + writes
    return {"flop_ms": (gemm + attn) / (peak_tflops * 1e9), "byte_ms": (weight_bytes + act_bytes) / (bw_tbs * 1e9)}


def measure_ceilings() -> tuple[float, float]:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    ms = cuda_time(lambda: a @ b, iters=10)
    tflops = 2 * 8192 ** 3 / ms / 1e9
    x = torch.randn(2 ** 30 // 2, device="cuda", dtype=torch.float16)
    y = torch.empty_like(x)
    ms = cuda_time(lambda: y.copy_(x), iters=10)
    bw = 2 * 2 ** 30 / ms / 1e9
    del a, b, x, y
    return tflops, bw


def hf_inputs(batch: int, lengths: list[int], width: int, rng):
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.from_numpy(rng.integers(1000, VOCAB, size=n))
        mask[r, :n] = 1
    return ids.cuda(), mask.cuda()


def surge_batch(lengths: list[int], rng) -> TokenBatch:
    items = [Encoded(rng.integers(1000, VOCAB, size=n), np.zeros(n, dtype=np.int64)) for n in lengths]
    return TokenBatch.pack(items)


def surge_model_ms(engine: TorchEngine, batch: TokenBatch) -> float:
    """Graph replay alone (inputs staged once), like the HF numbers: model-only time."""
    engine.run(batch)  # captures the bucket
    lengths = batch.lengths
    key = engine.bucket(len(lengths), int(lengths.sum()), int(lengths.max()))
    graph = engine._graph(key)[0]
    torch.cuda.synchronize()
    return cuda_time(graph.replay, iters=100, warmup=10)


def surge_v0_ms(engine: TorchEngine, batch: TokenBatch) -> float:
    from surge.engines.encoder import forward_reference, position_ids

    dev = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).cuda()  # noqa: E731
    ids, types = dev(batch.input_ids), dev(batch.token_type_ids)
    pos = dev(position_ids(batch.lengths, 0))
    cu = [0] + np.cumsum(batch.lengths).tolist()
    with torch.inference_mode():
        return cuda_time(lambda: forward_reference(engine.weights, ids, types, pos, cu), iters=10, warmup=2)


def surge_e2e_ms(engine: TorchEngine, batch: TokenBatch, iters: int = 100) -> float:
    from surge.bench.timing import wall_ms

    return float(np.median(wall_ms(lambda: engine.run(batch), iters, warmup=5)))


def hf_graph(model, ids, mask):
    static = {}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            model(input_ids=ids, attention_mask=mask)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static["out"] = model(input_ids=ids, attention_mask=mask).last_hidden_state
    return g.replay


def streams_bench(model_dir: Path, n_instances: int, lengths: list[int], seconds: float = 3.0) -> float:
    engines = [TorchEngine(device="cuda", precision="fp16", max_batch=len(lengths)) for _ in range(n_instances)]
    rng = np.random.default_rng(1)
    batch = surge_batch(lengths, rng)
    for e in engines:
        e.load(model_dir)
        e.run(batch)
    counts = [0] * n_instances
    stop = time.perf_counter() + seconds

    def loop(i):
        while time.perf_counter() < stop:
            engines[i].run(batch)
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(n_instances)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    el = time.perf_counter() - t0
    return sum(counts) * len(lengths) / el


def compile_rows(tmp: Path, args, rng) -> None:
    from transformers import BertModel

    fp16 = BertModel.from_pretrained(tmp, attn_implementation="sdpa", dtype=torch.float16,
                                     add_pooling_layer=False).cuda().eval()
    for name, lengths in [("b1_s32", [32]), ("b128_s32", [32] * 128)]:
        ids, mask = hf_inputs(len(lengths), lengths, 32, rng)
        t0 = time.perf_counter()
        comp = torch.compile(fp16, mode=args.compile, dynamic=False)
        with torch.inference_mode():
            comp(input_ids=ids, attention_mask=mask)
            build = time.perf_counter() - t0
            ms = cuda_time(lambda: comp(input_ids=ids, attention_mask=mask), iters=50)
        print(json.dumps({"workload": name, "compile_mode": args.compile, "torch_compile_ms": ms,
                          "seq_per_s": len(lengths) / ms * 1e3, "build_s": build}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_encoder.json")
    ap.add_argument("--compile", default="none", help="none, max-autotune, max-autotune-no-cudagraphs")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--compile-only", action="store_true", help="only the torch.compile rows (slow to build)")
    args = ap.parse_args()
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tflops, bw = measure_ceilings()
    print(f"ceilings: fp16 GEMM {tflops:.0f} TFLOP/s, copy {bw:.2f} TB/s", flush=True)
    cfg = BertConfig()  # bert-base-uncased shape
    tmp = Path(tempfile.mkdtemp())
    base = BertModel(cfg, add_pooling_layer=False).eval()
    base.save_pretrained(tmp)
    results: dict = {"ceilings": {"tflops": tflops, "tb_s": bw}, "rows": []}

    if args.compile_only:
        compile_rows(tmp, args, rng)
        return
    surge = TorchEngine(device="cuda", precision="fp16", max_batch=128)
    surge.load(tmp)
    surge_eager = TorchEngine(device="cuda", precision="fp16", max_batch=128, cuda_graphs=False)
    surge_eager.load(tmp)
    fp32 = BertModel.from_pretrained(tmp, attn_implementation="eager", add_pooling_layer=False).cuda().eval()
    fp16 = BertModel.from_pretrained(tmp, attn_implementation="sdpa", dtype=torch.float16,
                                     add_pooling_layer=False).cuda().eval()

    workloads = [("b1_s32", [32]), ("b128_s32", [32] * 128),
                 ("b64_u8_128", [int(n) for n in rng.integers(8, 129, size=64)])]
    for name, lengths in workloads:
        width = 128 if name.startswith("b64") else max(lengths)
        ids, mask = hf_inputs(len(lengths), lengths, width, rng)
        row = {"workload": name, "batch": len(lengths), "tokens": int(sum(lengths)), "padded_width": width}
        fl = floors(sum(lengths), lengths, tflops, bw)
        row["floor_ms"] = max(fl.values())
        row.update({f"floor_{k}": v for k, v in fl.items()})
        with torch.inference_mode():
            row["hf_eager_fp32_ms"] = cuda_time(lambda: fp32(input_ids=ids, attention_mask=mask), iters=20)
            row["hf_sdpa_fp16_ms"] = cuda_time(lambda: fp16(input_ids=ids, attention_mask=mask), iters=30)
        row["hf_sdpa_fp16_graph_ms"] = cuda_time(hf_graph(fp16, ids, mask), iters=100)
        if args.compile != "none" and name != "b64_u8_128":
            t0 = time.perf_counter()
            comp = torch.compile(fp16, mode=args.compile, dynamic=False)
            with torch.inference_mode():
                row["torch_compile_ms"] = cuda_time(lambda: comp(input_ids=ids, attention_mask=mask), iters=50)
            row["torch_compile_build_s"] = time.perf_counter() - t0
        b = surge_batch(lengths, rng)
        if name != "b128_s32" or not args.quick:
            row["v0_torch_ops_ms"] = surge_v0_ms(surge, b)  # our encoder, plain torch ops, eager
        row["v1_fused_eager_ms"] = cuda_time(lambda: surge_eager.run(b), iters=30)  # kernels, no graph (incl. copies)
        row["surge_ms"] = surge_model_ms(surge, b)
        row["surge_e2e_ms"] = surge_e2e_ms(surge, b)
        row["surge_gemm_choice"] = {str(k): v for k, v in surge.choices.items()}
        surge.choices.clear()
        row["surge_seq_per_s"] = len(lengths) / row["surge_ms"] * 1e3
        row["hf_graph_seq_per_s"] = len(lengths) / row["hf_sdpa_fp16_graph_ms"] * 1e3
        results["rows"].append(row)
        print(json.dumps(row), flush=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, lengths in workloads[:2]:
            b = surge_batch(lengths, rng)
            surge_eager.run(b)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    surge_eager.run(b)
            print(f"--- kernels, {name} (5 runs)")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    del fp32, fp16
    torch.cuda.empty_cache()
    stream_rows = []
    for lengths_name, lengths in [("b8_s64", [64] * 8), ("b1_s32", [32])]:
        base_tp = None
        for n in (1, 4, 8):
            tp = streams_bench(tmp, n, lengths, seconds=2.0 if args.quick else 3.0)
            base_tp = base_tp or tp
            stream_rows.append({"workload": lengths_name, "instances": n, "seq_per_s": tp, "gain": tp / base_tp})
            print(json.dumps(stream_rows[-1]), flush=True)
    results["streams"] = stream_rows
    Path(args.out).write_text(json.dumps(results, indent=1))

    print("\n| workload | v0 torch ops | v1 fused kernels, no graph | v2 + CUDA graph |\n|---|---|---|---|")
    for r in results["rows"]:
        print(f"| {r['workload']} | {r.get('v0_torch_ops_ms', float('nan')):.3f} | {r['v1_fused_eager_ms']:.3f} | {r['surge_ms']:.3f} |")
    print("\n| workload | floor ms | HF eager FP32 | HF SDPA FP16 | HF FP16 + graph | compile | surge | surge e2e | surge seq/s | x HF graph |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        comp = f"{r['torch_compile_ms']:.3f}" if "torch_compile_ms" in r else "-"
        print(f"| {r['workload']} | {r['floor_ms']:.3f} | {r['hf_eager_fp32_ms']:.3f} | {r['hf_sdpa_fp16_ms']:.3f} | "
              f"{r['hf_sdpa_fp16_graph_ms']:.3f} | {comp} | {r['surge_ms']:.3f} | {r['surge_e2e_ms']:.3f} | "
              f"{r['surge_seq_per_s']:.0f} | {r['hf_sdpa_fp16_graph_ms'] / r['surge_ms']:.2f} |")
    print("\n| workload | instances | seq/s | gain |\n|---|---|---|---|")
    for r in stream_rows:
        print(f"| {r['workload']} | {r['instances']} | {r['seq_per_s']:.0f} | {r['gain']:.2f} |")


if __name__ == "__main__":
    main()

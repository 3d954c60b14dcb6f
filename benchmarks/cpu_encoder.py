"""Latency of the bundled model on the CPU: PyTorch eager FP32 vs surge's ONNX Runtime engine.

Model-only time (tokenization excluded, same token batches for both), batch 1
and 32 at sequence 32. Prints a table of medians, p99 and the speed-up ratio.

    python benchmarks/cpu_encoder.py [--iters 200] [--threads 2]
"""

from __future__ import annotations

import argparse
import os

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seq", type=int, default=32)
    args = ap.parse_args()

    import torch

    from surge.bench.timing import cpu_name, wall_ms
    from surge.config import default_cache_dir
    from surge.engines.base import random_batch
    from surge.engines.onnxrt import OnnxRuntimeEngine
    from surge.models import bundled_model_dir, load_model_spec
    from surge.optimize.export import ensure_exported, load_torch_model

    torch.set_num_threads(args.threads)
    spec = load_model_spec(bundled_model_dir())
    artifact = ensure_exported(spec, default_cache_dir())
    engine = OnnxRuntimeEngine(threads=args.threads)
    engine.load(artifact)
    model = load_torch_model(spec)

    rows = []
    for batch_size in (1, 32):
        batch = random_batch(batch_size, args.seq, spec.vocab_size, seed=batch_size)
        ids = torch.from_numpy(batch.input_ids)
        mask = torch.from_numpy(batch.attention_mask)
        types = torch.from_numpy(batch.token_type_ids)

        def torch_run():
            with torch.inference_mode():
                model(input_ids=ids, attention_mask=mask, token_type_ids=types)

        t_torch = wall_ms(torch_run, args.iters, warmup=10)
        t_ort = wall_ms(lambda: engine.run(batch), args.iters, warmup=10)
        rows.append((batch_size, t_torch, t_ort))

    print(f"\nbundled all-MiniLM-L6-v2, seq {args.seq}, {args.threads} threads, {args.iters} iterations, "
          f"{cpu_name()}, torch {torch.__version__}")
    print(f"{'batch':>5} | {'torch eager p50':>15} {'p99':>8} | {'surge ORT p50':>13} {'p99':>8} | {'speed-up (p50)':>14}")
    print("-" * 80)
    for b, tt, to in rows:
        print(f"{b:>5} | {np.median(tt):>12.2f} ms {np.percentile(tt, 99):>6.2f} ms | "
              f"{np.median(to):>10.2f} ms {np.percentile(to, 99):>6.2f} ms | {np.median(tt) / np.median(to):>13.2f}x")


if __name__ == "__main__":
    main()

"""Double-buffered staging on one CUDA engine: batches/s with one caller (each batch packed,
copied, run, copied back and waited for before the next) against two callers (batch k+1
packed and copied while batch k runs), and two instances (two streams, two workspaces).

    PYTHONPATH=src python3 benchmarks/gpu_pipeline.py MODEL_DIR [--seconds 2] [--out OUT.json]

Real sentences (surge.data), FP16, every bucket built before timing. Prints a table.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", type=Path)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    from surge.data import load_sentences
    from surge.engines.torch_gpu import TorchEngine
    from surge.models import load_model_spec
    from surge.runtime.tokenize import Tokenizer
    from surge.runtime.worker import EnginePool
    from surge.types import TokenBatch

    spec = load_model_spec(args.model_dir)
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    sentences = load_sentences()
    rng = np.random.default_rng(0)
    engines = []
    for _ in range(2):
        e = TorchEngine(device="cuda", precision="fp16", max_batch=64, max_tokens=8192, pipeline_depth=2)
        e.load(args.model_dir)
        e.attach_pooling(spec.pooling)  # as served: rows, not hidden states, come back
        e.warmup([(1, 16)])
        engines.append(e)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        jobs = [TokenBatch.pack(tok.encode([sentences[i] for i in rng.choice(len(sentences), b, replace=False)]))
                for _ in range(64)]
        for name, pool, callers in (("1 caller", EnginePool([engines[0]]), 1),
                                    ("2 callers, double-buffered", EnginePool([engines[0]]), 2),
                                    ("2 instances x 2 buffers, 4 callers", EnginePool(engines), 4)):
            done = [0] * callers
            end = time.perf_counter() + args.seconds

            def work(k):
                j = k
                while time.perf_counter() < end:
                    pool.run(jobs[j % len(jobs)])
                    j += callers
                    done[k] += 1

            for j in jobs[:4]:
                pool.run(j)
            t0 = time.perf_counter()
            ts = [threading.Thread(target=work, args=(k,)) for k in range(callers)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            took = time.perf_counter() - t0
            n = sum(done)
            rows.append({"batch": b, "mode": name, "batches_s": n / took, "seq_s": n * b / took,
                         "ms_per_batch": took / n * 1000 * callers})
    print("| batch (sentences) | mode | batches/s | sequences/s | ms per batch (per caller) |")
    print("|---:|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['mode']} | {r['batches_s']:,.0f} | {r['seq_s']:,.0f} | {r['ms_per_batch']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

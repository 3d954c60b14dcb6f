"""Engine-only ceiling of batching on the CPU: cost per sequence at batch 1 vs larger batches.

    PYTHONPATH=src python benchmarks/cpu_engine_batching.py [--threads 1] [--reps 15]

The serving benchmark (runtime_serving.py) can gain from batching at most what
the engine gains: if one sequence alone costs X ms and one sequence inside a
batch of 32 costs Y ms, batching on can give at most ~X/Y the throughput. This
script measures X and Y on the same short real queries (5-20 tokens) for

* ONNX Runtime FP32 (surge's default CPU engine; padded batches),
* the torch engine's CPU path (encoder_cpu) in FP32 and BF16 (packed batches;
  BF16 GEMMs run on AMX tiles where the CPU has them),
* the old per-sequence torch path (encoder.forward_reference) in BF16, as the baseline
  the new CPU path replaces.

Engines are timed in interleaved rounds (each round runs every engine on every
batch size, a few calls back to back after one untimed call, as a server runs
them), so background load on a shared machine hits all of them alike;
the tables show medians over rounds: wall-clock time, and the CPU time of the
calling thread (with 1 intra-op thread both engines compute on the calling
thread), which time spent descheduled by other processes does not inflate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_engines(threads: int, which: list[str]):
    import torch

    from surge.config import default_cache_dir
    from surge.engines.encoder import forward_reference, position_ids
    from surge.engines.onnxrt import OnnxRuntimeEngine
    from surge.engines.torch_gpu import TorchEngine
    from surge.models import bundled_model_dir, load_model_spec
    from surge.optimize.export import ensure_exported
    from surge.types import TokenBatch

    torch.set_num_threads(threads)
    spec = load_model_spec(bundled_model_dir())
    engines = {}
    if "ort-fp32" in which:
        ort = OnnxRuntimeEngine(threads=threads)
        ort.load(ensure_exported(spec, default_cache_dir()))
        engines["ort-fp32"] = lambda items: ort.run(TokenBatch.pad(items))
    for prec in ("fp32", "bf16"):
        if f"torch-{prec}" in which:
            eng = TorchEngine(device="cpu", precision=prec, max_batch=256, threads=threads)
            eng.load(spec.path)
            engines[f"torch-{prec}"] = lambda items, e=eng: e.run(TokenBatch.pack(items))
    if "torch-bf16-per-seq" in which:
        ref = TorchEngine(device="cpu", precision="bf16", max_batch=256, threads=threads)
        ref.load(spec.path)

        def per_seq(items, w=ref.weights):
            b = TokenBatch.pack(items)
            t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64))  # noqa: E731
            with torch.inference_mode():
                forward_reference(w, t(b.input_ids), t(b.token_type_ids), t(position_ids(b.lengths, 0)),
                                  [0] + np.cumsum(b.lengths).tolist()).float().numpy()

        engines["torch-bf16-per-seq"] = per_seq
    return spec, engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="Intra-op threads (1: as the serving benchmark's servers).")
    ap.add_argument("--reps", type=int, default=15, help="Interleaved rounds; the table shows medians.")
    ap.add_argument("--calls", type=int, default=4,
                    help="Timed back-to-back calls per engine and batch size per round.")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--engines", default="ort-fp32,torch-fp32,torch-bf16,torch-bf16-per-seq")
    ap.add_argument("--out", type=Path, default=None, help="Write the results as JSON here.")
    args = ap.parse_args()

    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    from benchmarks.runtime_serving import short_queries
    from surge.bench.timing import cpu_name
    from surge.runtime.tokenize import Tokenizer

    spec, engines = build_engines(args.threads, args.engines.split(","))
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    sizes = [int(b) for b in args.batches.split(",")]
    queries = tok.encode(short_queries(max(sizes) * 4, seed=7))
    rng = np.random.default_rng(0)
    batches = {b: [[queries[i] for i in rng.choice(len(queries), b, replace=False)] for _ in range(3)] for b in sizes}
    times: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    for name, run in engines.items():  # warm-up: first calls build oneDNN primitives
        for b in sizes:
            run(batches[b][0])
    for rnd in track(range(args.reps), description="interleaved rounds"):
        for name, run in engines.items():
            for b in sizes:
                # Back-to-back calls, the first one untimed: a server runs one engine's batches back to
                # back, so its weights are warm in the caches; the other engines' runs evict them.
                for k in range(args.calls + 1):
                    items = batches[b][(rnd + k) % 3]
                    c0, t0 = time.thread_time(), time.perf_counter()
                    run(items)
                    if k:
                        times.setdefault((name, b), []).append((time.perf_counter() - t0) * 1e3 / b)
                        cpu.setdefault((name, b), []).append((time.thread_time() - c0) * 1e3 / b)

    mean_tokens = float(np.mean([len(q) for q in queries]))
    ref_b = 32 if 32 in sizes else sizes[-1]
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_name(),
              "threads": args.threads, "command": " ".join(sys.argv), "mean_tokens": mean_tokens}
    for label, data in (("wall-clock", times), ("thread CPU time", cpu)):
        med = {k: float(np.median(v)) for k, v in data.items()}
        result[label] = {f"{n}@{b}": v for (n, b), v in med.items()}
        t = Table(title=f"{label}, ms per sequence (median of {args.reps} rounds), short queries "
                        f"({mean_tokens:.1f} tokens on average), {args.threads} thread(s), {cpu_name()}")
        t.add_column("engine")
        for b in sizes:
            t.add_column(f"batch {b}", justify="right")
        t.add_column(f"batch 1 / batch {ref_b}", justify="right")
        for name in engines:
            t.add_row(name, *[f"{med[(name, b)]:.3f}" for b in sizes],
                      f"{med[(name, 1)] / med[(name, ref_b)]:.2f}x" if 1 in sizes else "")
        Console().print(t)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""What batch invariance costs the tensor-parallel encoder on the CPU (gloo ranks on one host).

Two TensorParallelEngines over the bundled MiniLM, batch_invariant on and off, each with its own rank
processes (`--threads` CPU threads per rank): each round draws one batch of random real sentences
(surge.data.load_sentences()) per size and runs it on both engines in turn (the order alternates), so
the shared VM's slow spells fall on both alike. Prints the median ms a batch and the ratio.

    PYTHONPATH=src OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_tp_batch_invariance.py [--world 2]
        [--threads 1] [--precision fp32] [--sizes 1,8,32] [--rounds 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--sizes", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch

    from surge.bench.timing import cpu_name
    from surge.data import load_sentences
    from surge.engines.tensor_parallel import TensorParallelEngine
    from surge.models import bundled_model_dir, load_model_spec
    from surge.runtime.tokenize import Tokenizer
    from surge.types import TokenBatch

    spec = load_model_spec(bundled_model_dir())
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    items = tok.encode(load_sentences())
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    engines = {}
    for name, inv in (("free", False), ("invariant", True)):
        e = TensorParallelEngine(world=args.world, precision=args.precision, max_batch=max(sizes),
                                 threads=args.threads, batch_invariant=inv)
        e.load(spec.path)
        engines[name] = e
    print(f"{cpu_name()}, torch {torch.__version__}, world {args.world} x {args.threads} threads, "
          f"{args.precision}, {args.rounds} rounds")
    times = {n: {b: [] for b in sizes} for n in engines}
    try:
        for b in sizes:  # warm-up
            batch = TokenBatch.pack([items[i] for i in rng.choice(len(items), b, replace=False)])
            for e in engines.values():
                for _ in range(3):
                    e.run(batch)
        for r in range(args.rounds):
            for b in sizes:
                batch = TokenBatch.pack([items[i] for i in rng.choice(len(items), b, replace=False)])
                order = list(engines) if r % 2 == 0 else list(engines)[::-1]
                for n in order:
                    t0 = time.perf_counter()
                    engines[n].run(batch)
                    times[n][b].append((time.perf_counter() - t0) * 1e3)
    finally:
        for e in engines.values():
            e.close()
    report = {"cpu": cpu_name(), "command": " ".join(sys.argv), "torch": torch.__version__, "results": {}}
    print("| setting | " + " | ".join(f"batch {b}" for b in sizes) + " |")
    print("| --- |" + " ---: |" * len(sizes))
    base = {b: statistics.median(times["free"][b]) for b in sizes}
    for n in engines:
        med = {b: statistics.median(times[n][b]) for b in sizes}
        report["results"][n] = med
        cells = [f"{med[b]:.2f}" + ("" if n == "free" else f" ({med[b] / base[b]:.2f}x)") for b in sizes]
        print(f"| {n} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

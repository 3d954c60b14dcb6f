"""What batch invariance costs the torch engine's CPU path (`engine: torch, device: cpu`).

The engine (TorchEngine.run on packed batches of random real sentences from
surge.data.load_sentences(), the bundled MiniLM) with batch_invariant on and off,
in one process: each round draws one batch per size and runs it on every setting
in turn (the settings' order rotates), so the shared, noisy VM's slow spells fall
on all of them alike. Prints medians per batch size and the ratio to the
non-invariant engine. --chunks / --attn-round try other layouts of the invariant form
(every GEMM in calls of N rows, the attention blocks rounded to N) as extra settings.

    PYTHONPATH=src python benchmarks/cpu_torch_batch_invariance.py [--precisions fp32,bf16] [--threads 2]
        [--sizes 1,8,32,64] [--rounds 60] [--chunks 16,32,64] [--attn-round 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="1,8,32,64")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--chunks", default="", help="extra invariant settings: every GEMM on chunks of this many rows "
                    "(the default chunks only those whose rows the CPU rounds by row count; 0: none, not invariant "
                    "where some must be chunked, to see the attention's share)")
    ap.add_argument("--attn-round", default="", help="extra invariant settings: attention block rounding")
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    import torch

    from surge.bench.timing import cpu_name
    from surge.data import load_sentences
    from surge.engines.torch_gpu import TorchEngine
    from surge.models import bundled_model_dir, load_model_spec
    from surge.runtime.tokenize import Tokenizer
    from surge.types import TokenBatch

    torch.set_num_threads(args.threads)
    spec = load_model_spec(bundled_model_dir())
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    items = tok.encode(load_sentences())
    sizes = [int(s) for s in args.sizes.split(",")]
    rng = np.random.default_rng(0)
    report = {"cpu": cpu_name(), "command": " ".join(sys.argv), "threads": args.threads, "torch": torch.__version__, "rounds": args.rounds,
              "results": {}}
    print(f"{cpu_name()}, torch {torch.__version__}, {args.threads} threads, {args.rounds} rounds, "
          f"{len(items)} sentences (mean {np.mean([len(i.ids) for i in items]):.1f} tokens)")
    for prec in args.precisions.split(","):
        engines: dict[str, TorchEngine] = {}
        for name, inv in (("free", False), ("invariant", True)):
            engines[name] = TorchEngine(device="cpu", precision=prec, max_batch=max(sizes), batch_invariant=inv)
        extra = [("chunk", int(c)) for c in args.chunks.split(",") if c] + \
                [("round", int(r)) for r in args.attn_round.split(",") if r]
        for kind, v in extra:
            engines[f"inv {kind} {v}"] = TorchEngine(device="cpu", precision=prec, max_batch=max(sizes),
                                                   batch_invariant=True)
        for name, e in engines.items():
            e.load(spec.path)
            if name.startswith("inv chunk"):
                e._cpu.gemm_chunks = [int(name.split()[-1])] * 4
            elif name.startswith("inv round"):
                e._cpu.attn_round = int(name.split()[-1])
        names = list(engines)
        times = {n: {b: [] for b in sizes} for n in names}
        batches = {b: [TokenBatch.pack([items[i] for i in rng.choice(len(items), b, replace=False)])
                       for _ in range(args.rounds)] for b in sizes}
        for b in sizes:  # warm-up: every setting sees every batch shape family once
            for n in names:
                for batch in batches[b][:3]:
                    engines[n].run(batch)
        for r in range(args.rounds):
            for b in sizes:
                order = names[r % len(names):] + names[:r % len(names)]
                for n in order:
                    t0 = time.perf_counter()
                    engines[n].run(batches[b][r])
                    times[n][b].append((time.perf_counter() - t0) * 1e3)
        print(f"\n{prec}: median ms per batch (ratio to free = batch_invariant off); the invariant default "
              f"chunks GEMMs {engines['invariant']._cpu.gemm_chunks} (QKV, output, FFN up, FFN down; 0: one call)")
        print(f"{'setting':>16} | " + " | ".join(f"{'batch ' + str(b):>15}" for b in sizes))
        print("-" * (19 + 18 * len(sizes)))
        free = {b: float(np.median(times["free"][b])) for b in sizes}
        res = {}
        for n in names:
            med = {b: float(np.median(times[n][b])) for b in sizes}
            res[n] = {str(b): {"median_ms": med[b], "ratio": med[b] / free[b],
                               "p90_ms": float(np.percentile(times[n][b], 90))} for b in sizes}
            print(f"{n:>16} | " + " | ".join(f"{med[b]:7.2f} {med[b] / free[b]:5.2f}x " for b in sizes))
        report["results"][prec] = res
        for e in engines.values():
            e.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

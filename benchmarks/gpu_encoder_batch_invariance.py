"""How much a sentence's embedding on the CUDA encoder depends on the batch it shares.

DESIGN.md promises that a result never depends on which other requests shared its batch. On
the CPU (ONNX Runtime) the unit tests hold that bit for bit; on the GPU a batch of more tokens
may be served by another bucket's graph and another GEMM tiling, whose sums round differently.
This probe measures how far apart the same sentence's vector is alone and in batches of random
neighbours (sizes 2-64, mixed lengths), per precision, as served (pooling inside the graph):

    PYTHONPATH=src python3 benchmarks/gpu_encoder_batch_invariance.py --model-dir DIR [--json OUT]

It prints, per precision and engine setting (`batch_invariant` on, the default since session 44,
and off, each bucket on its fastest GEMM mode): the share of sentences whose vector is
bit-identical in every batch, the largest absolute difference of a raw (unnormalized) pooled
value, the smallest cosine between a sentence alone and in a batch, and the smallest cosine to
the FP32 reference when one is given (`--reference ref_fp32.npy`, benchmarks/gpu_prepare.py
writes it). Then what invariance costs: each setting's batches of 1, 8, 32 and 64 random
sentences timed (median of `--reps` runs, us a batch, the settings interleaved) and their ratio.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def make_engine(model_dir: Path, precision: str, invariant: bool):
    from surge.engines.torch_gpu import TorchEngine

    engine = TorchEngine(device="cuda", precision=precision, max_batch=64, max_tokens=8192,
                         batch_invariant=invariant)
    engine.load(model_dir)
    engine.attach_pooling("mean")
    return engine


def probe(engine, precision: str, invariant: bool, tok, sentences: list[str], reference, trials: int,
          seed: int) -> dict:
    from surge.types import TokenBatch

    items = tok.encode(sentences)
    alone = np.concatenate([engine.run(TokenBatch.pack([x])) for x in items]).astype(np.float32)
    rng = np.random.default_rng(seed)
    worst_abs = np.zeros(len(items))
    worst_cos = np.ones(len(items))
    same = np.ones(len(items), dtype=bool)
    seen = np.zeros(len(items), dtype=int)
    for _ in range(trials):
        idx = rng.choice(len(items), int(rng.integers(2, 65)), replace=False)
        got = engine.run(TokenBatch.pack([items[i] for i in idx])).astype(np.float32)
        diff = np.abs(got - alone[idx]).max(1)
        worst_abs[idx] = np.maximum(worst_abs[idx], diff)
        worst_cos[idx] = np.minimum(worst_cos[idx], cosine(got, alone[idx]))
        same[idx] &= diff == 0
        seen[idx] += 1
    hit = seen > 0
    row = {
        "precision": precision, "batch_invariant": invariant, "sentences": int(hit.sum()), "trials": trials,
        "bit_identical_share": float(same[hit].mean()),
        "max_abs_diff": float(worst_abs[hit].max()), "median_abs_diff": float(np.median(worst_abs[hit])),
        "min_cosine_alone_vs_batched": float(worst_cos[hit].min()),
    }
    if reference is not None:
        row["min_cosine_alone_vs_fp32_reference"] = float(cosine(alone, reference).min())
    return row


def timings(engines: dict, tok, sentences: list[str], sizes: list[int], reps: int, seed: int) -> list[dict]:
    """us a batch (median of reps) per engine and batch size; the engines take turns batch by batch."""
    import time

    from surge.types import TokenBatch

    rng = np.random.default_rng(seed)
    rows = []
    for size in sizes:
        batches = [TokenBatch.pack(tok.encode([sentences[i] for i in rng.choice(len(sentences), size, replace=False)]))
                   for _ in range(reps)]
        took = {name: [] for name in engines}
        for batch in batches:
            for name, engine in engines.items():
                t0 = time.perf_counter()
                engine.run(batch)
                took[name].append((time.perf_counter() - t0) * 1e6)
        row = {"batch": size, **{name: float(np.median(v)) for name, v in took.items()}}
        rows.append(row)
    return rows


def table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="default: the bundled MiniLM")
    ap.add_argument("--reference", type=Path, default=None)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=200, help="timed batches per size and setting")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from surge.data import load_sentences
    from surge.models import bundled_model_dir, load_model_spec
    from surge.runtime.tokenize import Tokenizer

    model_dir = args.model_dir or bundled_model_dir()
    spec = load_model_spec(model_dir)
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    sentences = load_sentences()
    reference = np.load(args.reference) if args.reference else None
    rows, speed = [], {}
    for precision in ("fp16", "bf16"):
        engines = {}
        for invariant in (True, False):
            engine = engines[f"{precision} {'invariant' if invariant else 'per-bucket'} us"] = make_engine(
                model_dir, precision, invariant)
            rows.append(probe(engine, precision, invariant, tok, sentences, reference, args.trials, args.seed))
        speed[precision] = timings(engines, tok, sentences, [1, 8, 32, 64], args.reps, args.seed)
        for r in speed[precision]:
            inv, per = (r[k] for k in engines)
            r["invariant / per-bucket"] = inv / per
        for engine in engines.values():
            engine.close()
    table(rows)
    for timed in speed.values():
        print()
        table(timed)
    if args.json:
        args.json.write_text(json.dumps({"invariance": rows, "timings": speed}, indent=1))


if __name__ == "__main__":
    main()

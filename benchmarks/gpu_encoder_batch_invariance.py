"""How much a sentence's embedding on the CUDA encoder depends on the batch it shares.

DESIGN.md promises that a result never depends on which other requests shared its batch. On
the CPU (ONNX Runtime) the unit tests hold that bit for bit; on the GPU a batch of more tokens
may be served by another bucket's graph and another GEMM tiling, whose sums round differently.
This probe measures how far apart the same sentence's vector is alone and in batches of random
neighbours (sizes 2-64, mixed lengths), per precision, as served (pooling inside the graph):

    PYTHONPATH=src python3 benchmarks/gpu_encoder_batch_invariance.py --model-dir DIR [--json OUT]

It prints, per precision: the share of sentences whose vector is bit-identical in every batch,
the largest absolute difference of a raw (unnormalized) pooled value, the smallest cosine between
a sentence alone and in a batch, and the smallest cosine to the FP32 reference when one is given
(`--reference ref_fp32.npy`, benchmarks/gpu_prepare.py writes it).
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


def probe(model_dir: Path, precision: str, sentences: list[str], reference, trials: int, seed: int) -> dict:
    from surge.engines.torch_gpu import TorchEngine
    from surge.models import load_model_spec
    from surge.runtime.tokenize import Tokenizer
    from surge.types import TokenBatch

    spec = load_model_spec(model_dir)
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    engine = TorchEngine(device="cuda", precision=precision, max_batch=64, max_tokens=8192)
    engine.load(model_dir)
    engine.attach_pooling("mean")
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
        "precision": precision, "sentences": int(hit.sum()), "trials": trials,
        "bit_identical_share": float(same[hit].mean()),
        "max_abs_diff": float(worst_abs[hit].max()), "median_abs_diff": float(np.median(worst_abs[hit])),
        "min_cosine_alone_vs_batched": float(worst_cos[hit].min()),
    }
    if reference is not None:
        row["min_cosine_alone_vs_fp32_reference"] = float(cosine(alone, reference).min())
    engine.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="default: the bundled MiniLM")
    ap.add_argument("--reference", type=Path, default=None)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from surge.data import load_sentences
    from surge.models import bundled_model_dir

    model_dir = args.model_dir or bundled_model_dir()
    sentences = load_sentences()
    reference = np.load(args.reference) if args.reference else None
    rows = [probe(model_dir, p, sentences, reference, args.trials, args.seed) for p in ("fp16", "bf16")]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for r in rows:
        print("| " + " | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""Which one tiling the batch-invariant CUDA encoder should use: each candidate (GEMM tile, warps, stages;
the attention's fixed tile) timed against the per-bucket engine (batch_invariant=False) in the same process,
batches of 1, 8, 32 and 64 random real sentences taking turns, and checked bit-invariant (each sentence
alone against random batches of it):

    PYTHONPATH=src python3 benchmarks/gpu_invariant_tiles.py --model-dir DIR [--json OUT]

Prints one row a candidate: us a batch (median) per size, the ratio to the per-bucket engine, and whether
every sentence kept its bits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, attention tile)
CANDIDATES = [
    (64, 64, 64, 8, 4, 4, 64), (64, 64, 64, 8, 4, 4, 32), (64, 128, 64, 8, 4, 3, 64), (128, 64, 64, 8, 4, 3, 64),
    (128, 128, 64, 8, 8, 3, 64), (64, 32, 128, 8, 4, 3, 64), (32, 64, 128, 8, 4, 4, 64), (16, 64, 128, 1, 4, 3, 64),
    (32, 32, 128, 1, 4, 3, 32),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    import benchmarks.gpu_encoder_batch_invariance as probe
    from surge.data import load_sentences
    from surge.engines.kernels import attention, gemm
    from surge.models import bundled_model_dir, load_model_spec
    from surge.runtime.tokenize import Tokenizer

    model_dir = args.model_dir or bundled_model_dir()
    spec = load_model_spec(model_dir)
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    sentences = load_sentences()
    free = probe.make_engine(model_dir, args.precision, False)
    rows = []
    for bm, bn, bk, gm, warps, stages, attn in CANDIDATES:
        gemm.INVARIANT.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm)
        gemm.INVARIANT_LAUNCH.update(num_warps=warps, num_stages=stages)
        attention.INVARIANT_BLOCK = attn
        name = f"{bm}x{bn}x{bk} g{gm} w{warps} s{stages} attn{attn}"
        try:
            inv = probe.make_engine(model_dir, args.precision, True)
            check = probe.probe(inv, args.precision, True, tok, sentences[:160], None, 40, 1)
            timed = probe.timings({"inv": inv, "free": free}, tok, sentences, [1, 8, 32, 64], args.reps, 2)
            inv.close()
        except Exception as exc:  # noqa: BLE001 - a tiling that does not compile here is reported, not fatal
            rows.append({"candidate": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
            print(rows[-1], flush=True)
            continue
        row = {"candidate": name, "bit_identical_share": check["bit_identical_share"]}
        for r in timed:
            row[f"b{r['batch']} us"] = r["inv"]
            row[f"b{r['batch']} ratio"] = r["inv"] / r["free"]
        row["mean ratio"] = float(np.mean([r["inv"] / r["free"] for r in timed]))
        rows.append(row)
        print(row, flush=True)
    ok = [r for r in rows if "error" not in r]
    if ok:
        probe.table(sorted(ok, key=lambda r: r["mean ratio"]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

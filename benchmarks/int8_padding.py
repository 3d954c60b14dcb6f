"""Issue 21, session 12: FP32 and INT8 artifacts on batches with and without padding, one thread, interleaved.

Batches of B held-out queries, either drawn at random (what a batcher that does not sort would send: ~40%
of the padded tokens are padding at B = 8) or consecutive in length order (~0%); CPU time a query
(process time over 60 batches, median of 3 interleaved rounds). The server's own padding share is
`surge_batch_padding_ratio` on /metrics.

    PYTHONPATH=src python benchmarks/int8_padding.py FP32_ARTIFACT INT8_ARTIFACT --batch 8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from surge.data import heldout_queries
from surge.optimize import validate


def session(art: Path):
    """The artifact as the server runs it: one thread, no spinning, its manifest's disabled optimizers."""
    m = json.loads((art / "manifest.json").read_text())
    return validate.session(art / m.get("model_file", "model.onnx"), threads=1,
                            disabled_optimizers=m.get("ort_disabled_optimizers", []), spinning=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fp32", type=Path)
    ap.add_argument("int8", type=Path)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.fp32 / "tokenizer.json"))
    tok.no_padding()
    enc = [e.ids for e in tok.encode_batch(heldout_queries())]
    by_len = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    sess = {"fp32": session(args.fp32), "int8": session(args.int8)}
    rng = np.random.default_rng(0)
    b = args.batch

    def padded(ids):
        width = max(map(len, ids))
        x = np.zeros((len(ids), width), np.int64)
        m = np.zeros_like(x)
        for i, r in enumerate(ids):
            x[i, : len(r)], m[i, : len(r)] = r, 1
        return x, m

    print(f"| batches of {b} | padding share | FP32 ms a query | INT8 ms a query | FP32 / INT8 |\n| --- | ---: | ---: | ---: | ---: |")
    for kind in ("random", "length-sorted"):
        batches = []
        for _ in range(args.batches):
            if kind == "random":
                ids = [enc[i] for i in rng.choice(len(enc), b, replace=False)]
            else:
                s = int(rng.integers(0, len(enc) - b))
                ids = [enc[i] for i in by_len[s : s + b]]
            batches.append(padded(ids))
        pad = float(np.mean([1 - m.sum() / m.size for _, m in batches]))
        res = {n: [] for n in sess}
        for _ in range(args.rounds):
            for n, s in sess.items():
                names = {i.name for i in s.get_inputs()}
                t = time.process_time()
                for x, m in batches:
                    feed = {"input_ids": x, "attention_mask": m}
                    if "token_type_ids" in names:
                        feed["token_type_ids"] = np.zeros_like(x)
                    s.run(None, feed)
                res[n].append((time.process_time() - t) / (len(batches) * b) * 1e3)
        f, i = (float(np.median(res[n])) for n in ("fp32", "int8"))
        print(f"| {kind} | {pad:.3f} | {f:.3f} | {i:.3f} | {f / i:.2f} |")


if __name__ == "__main__":
    main()

"""A step's cost of one request's large bad_words / logit_bias lists to every sequence of its batch: the sampler's
`_penalize` over 64 rows of Qwen2's vocabulary (151,936) on the CPU, one row carrying N bad words (a third one
token, the rest two to four) or N logit biases, the output ending with some words' prefixes. Median of the
rounds, ms a step; with --baseline SRC the same measurement runs on another tree (e.g. a worktree of the
previous commit) in a subprocess, and the table shows both and their ratio.

    python benchmarks/sampler_bans.py --baseline /tmp/old/src
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

V, ROWS = 151_936, 64


def measure(n: int, kind: str, rounds: int) -> float:
    import torch

    from surge.engines.decoder.sampler import Sampler
    from surge.runtime.scheduler import SamplingParams, Sequence

    rng = random.Random(0)
    out = [rng.randrange(V) for _ in range(40)]
    if kind == "bad_words":
        words = {(rng.randrange(V),) if k % 3 == 0 else tuple(rng.randrange(V) for _ in range(2 + k % 3))
                 for k in range(n)}
        big = SamplingParams(max_tokens=64, bad_words_ids=tuple(words))
    else:
        big = SamplingParams(max_tokens=64, logit_bias=tuple((rng.randrange(V), 1.0) for _ in range(n)))
    plain = SamplingParams(max_tokens=64, repetition_penalty=1.1)  # penalized rows: they go through _penalize too
    seqs = []
    for i in range(ROWS):
        s = Sequence(i, [1, 2, 3], big if i == 0 else plain)
        s.output_ids, s.token_ids = list(out), [1, 2, 3] + list(out)
        seqs.append(s)
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(ROWS, V)
    times = []
    for _ in range(rounds):
        x = logits.clone()
        t = time.perf_counter()
        sampler._penalize(x, seqs)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3  # the first step builds what later steps reuse


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", help="another tree's src directory, measured in a subprocess")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--sizes", default="0,1000,10000,100000")
    ap.add_argument("--json-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    cases = [(kind, int(n)) for kind in ("bad_words", "logit_bias") for n in a.sizes.split(",")]
    cases = [c for c in cases if not (c[0] == "logit_bias" and c[1] > V)]
    mine = {f"{k}:{n}": measure(n, k, a.rounds) for k, n in cases}
    if a.json_only:
        print(json.dumps(mine))
        return
    base = None
    if a.baseline:
        env = {**os.environ, "PYTHONPATH": a.baseline}
        run = subprocess.run([sys.executable, __file__, "--json-only", "--rounds", str(a.rounds), "--sizes", a.sizes],
                             env=env, capture_output=True, text=True, check=True)
        base = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"_penalize, {ROWS} rows x {V} logits, CPU, median of {a.rounds - 1} steps, ms a step\n")
    print("| one row's list | this tree |" + (" baseline | baseline / this |" if base else ""))
    print("|---|---:|" + ("---:|---:|" if base else ""))
    for k, n in cases:
        key = f"{k}:{n}"
        row = f"| {n:,} {k} | {mine[key]:.2f} |"
        if base:
            row += f" {base[key]:.2f} | {base[key] / mine[key]:.1f}x |"
        print(row)


if __name__ == "__main__":
    main()

"""What a structured-output guide costs the engine's step, the figures runtime/guided.py's limits rest on.

    PYTHONPATH=src python benchmarks/guide_costs.py [--rounds 5]

Two tables, on the tiny test tokenizer (tests/decoder_models.train_tokenizer, 512 tokens), medians of the rounds:
1. A request's n matchers of one costly guide within the limits (regex `[ab]{1000}{4}`): n fresh llguidance builds (the old way, each
   in the engine's step) against Guides.matcher's copies of one kept build (the new way), same run.
2. A mask a step for a guide that forces N bytes at once (a single choice of N characters): the cost that grows with
   N, which MAX_FORCED_BYTES bounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    import llguidance

    from surge.runtime.guided import Guides, guide_for
    from tests.decoder_models import train_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=16, help="a request's sequences")
    a = ap.parse_args()
    tok = train_tokenizer(512, True).to_str()

    guide = guide_for("regex", "[ab]{1000}{4}", "guided_regex")
    fresh, copies = [], []
    for _ in range(a.rounds):
        guides = Guides(tok, 512, [2])
        g, error = guides._compiled(guide)
        assert error is None, error
        t = time.perf_counter()
        for _ in range(a.n):
            llguidance.LLMatcher(guides.tokenizer, g, log_level=0).compute_bitmask()
        fresh.append(time.perf_counter() - t)
        guides = Guides(tok, 512, [2])
        t = time.perf_counter()
        for _ in range(a.n):
            guides.matcher(guide).mask()
        copies.append(time.perf_counter() - t)
    print(f"{a.n} matchers of regex [ab]{{1000}}{{4}}, each with its first mask, s (median of {a.rounds}):")
    print("| way | s | rounds |\n|---|---:|---|")
    print(f"| fresh builds (before) | {statistics.median(fresh):.3f} | {' '.join(f'{x:.3f}' for x in fresh)} |")
    print(f"| copies of one build (Guides.matcher) | {statistics.median(copies):.3f} | "
          f"{' '.join(f'{x:.3f}' for x in copies)} |")
    print(f"ratio: {statistics.median(fresh) / statistics.median(copies):.1f}x\n")

    print("a mask a step, guide forcing N bytes (a single choice of N 'a's), us (median of the rounds' medians):")
    print("| N | us a mask | us a forced KB |\n|---:|---:|---:|")
    guides = Guides(tok, 512, [2])
    for n in (64, 1024, 8192, 65536, 262144):
        g = guides_grammar(guide_for("choice", ["a" * n], "guided_choice"))  # past the bound too: measured anyway
        m = llguidance.LLMatcher(guides.tokenizer, g, log_level=0)
        per = []
        for _ in range(a.rounds):
            times = []
            for _ in range(20):
                t = time.perf_counter()
                m.compute_bitmask()
                times.append(time.perf_counter() - t)
            per.append(np.median(times))
        us = statistics.median(per) * 1e6
        print(f"| {n} | {us:.1f} | {us / (n / 1024):.2f} |")


def guides_grammar(guide):
    from surge.runtime.guided import grammar

    return grammar(guide)


if __name__ == "__main__":
    main()

"""One query tokenized the way the server does it: the Python fast path against `tokenizers`.

    PYTHONPATH=src python3 benchmarks/tokenize_fast.py [--calls 400] [--gaps-ms 0,1,5]

`surge.runtime.tokenize.Tokenizer.encode([query])` for the bundled model, with its fast path
(runtime/fast_wordpiece.py) and with it switched off (tokenizers' batch call), interleaved call
by call on held-out queries. A lone request tokenizes on cold caches, so each pair of calls is
also measured after sleeping between calls (--gaps-ms). Prints medians (us) and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from surge.data import heldout_queries
from surge.models import bundled_model_dir, load_model_spec
from surge.runtime.tokenize import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=400)
    p.add_argument("--gaps-ms", default="0,1,5")
    a = p.parse_args()
    spec = load_model_spec(bundled_model_dir())
    fast = Tokenizer(spec.tokenizer_file, max_length=spec.max_length, vocab_size=spec.vocab_size)
    plain = Tokenizer(spec.tokenizer_file, max_length=spec.max_length, vocab_size=spec.vocab_size)
    plain._fast = None
    if fast._fast is None:
        raise SystemExit("the bundled tokenizer has no fast path")
    queries = [q for q in heldout_queries() if q.isascii()]
    print("| gap between calls | tokenizers us | fast path us | ratio |\n|---|---:|---:|---:|")
    for gap_ms in (float(g) for g in a.gaps_ms.split(",")):
        times = {"plain": [], "fast": []}
        for i in range(a.calls):
            q = [queries[i % len(queries)]]
            for name, tok in (("plain", plain), ("fast", fast)) if i % 2 else (("fast", fast), ("plain", plain)):
                if gap_ms:
                    time.sleep(gap_ms / 1000)
                t = time.perf_counter_ns()
                tok.encode(q)
                times[name].append(time.perf_counter_ns() - t)
        pm, fm = (statistics.median(times[k]) / 1000 for k in ("plain", "fast"))
        print(f"| {gap_ms:g} ms | {pm:.1f} | {fm:.1f} | {pm / fm:.1f}x |")


if __name__ == "__main__":
    main()

"""From a gpu_decode_attention.py --json sweep: the generate_ab variants that put its best key-slice counts
in the engine (session 20). For each slice count, the fastest keys-a-tile at the engine's launch shape
(--warps, --stages: what generate_ab's "ta" option sets for every variant); prints the comma-separated
variants `BASE+attnN+kvS`, the one-program kernel first.

    python3 benchmarks/pick_kv_variants.py sweep.json BASE [--warps 4 --stages 3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sweep", type=Path)
    ap.add_argument("base")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    args = ap.parse_args()
    best: dict[int, dict] = {}
    for r in json.loads(args.sweep.read_text())["rows"]:
        if r["path"] != "decode_attention" or (r["num_warps"], r["num_stages"]) != (args.warps, args.stages):
            continue
        ks = r.get("kv_splits", 1)
        if ks not in best or r["us"] < best[ks]["us"]:
            best[ks] = r
    print(",".join(f"{args.base}+attn{r['block_n']}+kv{ks}" for ks, r in sorted(best.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

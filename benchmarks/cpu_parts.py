"""Micro-benchmarks behind three CPU-path choices, each against the code it replaced, in one run.

    PYTHONPATH=src:. python3 benchmarks/cpu_parts.py [--threads 2] [--rounds 7]

1. Decoder linear layers (engines/decoder/cpu_layout.py): F.linear with the weight
   [out, in] (before) against torch.addmm / x @ W with the weight [in, out] (now), GPT-2 small's
   FFN-in shape at 1-512 rows and its 50,257-row LM head at 8 rows.
2. Decode-step paged attention (engines/decoder/attention.py): the sequence loop (before) against
   the batched step (now), 8 sequences of 80-100 cached tokens, 12 layers with their own caches.
3. KServe statistics (runtime/stats.py): one record without the --workers mirror (before) and
   with it (now).
4. The batched decode attention on a BF16 cache (engines/decoder/attention.py, session 34): torch's
   SDPA in BF16 on the gathered K/V (before) against the gathered K/V upcast to FP32 and attended there
   (now), the same 8 sequences x 12 layers, 110-130 cached tokens.

Medians of interleaved rounds; prints a table (ratio = before / now).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F


def _time(fn, n: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def linear_cases():
    g = torch.Generator().manual_seed(0)
    out = []
    for rows in (1, 8, 64, 512):
        x = torch.randn(rows, 768, generator=g)
        ws = [torch.randn(3072, 768, generator=g) for _ in range(12)]  # 12 layers: weights not in cache
        wt = [w.t().contiguous() for w in ws]
        b = torch.randn(3072, generator=g)
        out.append((f"linear 768->3072, {rows} rows x 12 layers",
                    lambda x=x, ws=ws, b=b: [F.linear(x, w, b) for w in ws],
                    lambda x=x, wt=wt, b=b: [torch.addmm(b, x, w) for w in wt]))
    x = torch.randn(8, 768, generator=g)
    head = torch.randn(50257, 768, generator=g)
    head_t = head.t().contiguous()
    out.append(("LM head 768->50,257, 8 rows", lambda: F.linear(x, head), lambda: x @ head_t))
    return out


SEQS, HEADS, DIM, BLOCK, BLOCKS, LAYERS = 8, 12, 64, 16, 512, 12  # GPT-2 small's decode attention, 8 streams


def decode_step(seed: int, lo: int, hi: int, dtype=torch.float32):
    """A decode step's attention inputs: (a fresh metadata each call, the layers' caches, q), SEQS sequences of
    lo-hi cached positions in random blocks."""
    from surge.engines.decoder.attention import AttnMeta

    rng = np.random.default_rng(seed)
    ctx = [int(c) for c in rng.integers(lo, hi, SEQS)]
    free = list(rng.permutation(BLOCKS))
    tables = [[int(free.pop()) for _ in range(-(-c // BLOCK))] for c in ctx]

    def meta():  # a fresh step: the batched path builds its gather once per step
        return AttnMeta(slot_mapping=torch.zeros(SEQS, dtype=torch.long), block_tables=torch.zeros(1),
                        context_lens=torch.tensor(ctx), query_start=torch.arange(SEQS + 1), max_query=1,
                        q_lens=[1] * SEQS, ctx_lens=ctx, tables=tables)

    caches = [(torch.randn(BLOCKS, BLOCK, HEADS, DIM).to(dtype), torch.randn(BLOCKS, BLOCK, HEADS, DIM).to(dtype))
              for _ in range(LAYERS)]
    return meta, caches, torch.randn(SEQS, HEADS, DIM).to(dtype)


def attention_case():
    from surge.engines.decoder.attention import paged_attention_loop, paged_attention_torch

    meta, caches, q = decode_step(0, 80, 100)
    dim = DIM

    def step(fn):
        m = meta()
        return [fn(q, k, v, m, dim ** -0.5) for k, v in caches]

    return ("decode attention, 8 seqs x ~90 tokens x 12 layers",
            lambda: step(paged_attention_loop), lambda: step(paged_attention_torch))


def bf16_attention_case():
    from surge.engines.decoder.attention import decode_gather, paged_attention_torch

    bf = torch.bfloat16
    meta, caches, q = decode_step(1, 110, 130, bf)
    heads, dim, block = HEADS, DIM, BLOCK

    def before():  # session 33's batched step: the gather, then SDPA in the cache's dtype
        slots, valid = decode_gather(meta(), block, q.device)
        flat, mask, (b, width) = slots.reshape(-1), valid[:, None, None, :], slots.shape
        kbuf, vbuf = torch.empty(flat.numel(), heads, dim, dtype=bf), torch.empty(flat.numel(), heads, dim, dtype=bf)
        out = []
        for k, v in caches:
            torch.index_select(k.view(-1, heads, dim), 0, flat, out=kbuf)
            torch.index_select(v.view(-1, heads, dim), 0, flat, out=vbuf)
            out.append(F.scaled_dot_product_attention(q[:, :, None, :], kbuf.view(b, width, heads, dim).transpose(1, 2),
                                                      vbuf.view(b, width, heads, dim).transpose(1, 2),
                                                      attn_mask=mask, scale=dim ** -0.5))
        return out

    def now():
        m = meta()
        return [paged_attention_torch(q, k, v, m, dim ** -0.5) for k, v in caches]

    return "decode attention on a BF16 cache, 8 seqs x ~120 tokens x 12 layers", before, now


def stats_case():
    from surge.runtime.stats import InferenceStats

    result = SimpleNamespace(vectors=np.zeros((1, 2)), cached=[False], timings={"queue_ns": 5, "compute_infer_ns": 6})
    plain, mirrored = InferenceStats(), InferenceStats(tempfile.mkdtemp(prefix="surge-stats-"))
    return ("KServe statistics, one record (x1000)",
            lambda: [plain.record_success("m", "1", result, 100) for _ in range(1000)],
            lambda: [mirrored.record_success("m", "1", result, 100) for _ in range(1000)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cases = linear_cases() + [attention_case(), stats_case(), bf16_attention_case()]
    times = {name: ([], []) for name, _, _ in cases}
    for _ in range(args.rounds):
        for name, before, now in cases:
            times[name][0].append(_time(before, 5))
            times[name][1].append(_time(now, 5))
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.rounds} interleaved rounds\n")
    print("| case | before (ms) | now (ms) | before / now |")
    print("|---|---:|---:|---:|")
    for name, (b, n) in times.items():
        mb, mn = statistics.median(b) * 1e3, statistics.median(n) * 1e3
        print(f"| {name} | {mb:.3f} | {mn:.3f} | {mb / mn:.2f}x |")


if __name__ == "__main__":
    main()

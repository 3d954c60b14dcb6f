"""A decoder embedding model (Qwen3-Embedding's shape) served by surge's decoder embedder against
transformers (what sentence-transformers runs), both pooling the last token and normalizing.

    python3 benchmarks/decoder_embed.py --device cpu --shape qwen3-tiny --threads 2
    python3 benchmarks/decoder_embed.py --device cuda --shape qwen3-0.6b

Random weights of the shape; batches of `--batch` short queries (token ids, `--min-len`..`--max-len`
tokens: the assistant's traffic), the same batches for both, interleaved rounds. surge runs the batch
packed (engines/decoder/embedder.py: on a GPU from the CUDA graph of its bucket, on the CPU as one
TorchScript call; the eager forward as a second row; `batch_invariant=False` as a third: by default a query's
vector is bit for bit the same whatever shares its batch, and the "moved" column counts the first batch's
queries whose vector alone differs from theirs in the batch); transformers the padded batch with its SDPA attention (right
padding, the last real token pooled), in the same dtype. `--busy-threads N` adds surge's rows with N
Python threads spinning beside it (a server's busy event loop: an eager forward re-takes the GIL at every
op). Reported: queries/s (median of rounds), the ratio, and the largest difference between the two engines'
unit vectors.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

SHAPES = {  # Qwen3-Embedding-0.6B's config, and a small one for 2 cores
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151669, max_position_embeddings=32768),
    "qwen3-tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, vocab_size=32000, max_position_embeddings=4096),
}


def build(shape: str, out: Path) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(bos_token_id=0, eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                                         **SHAPES[shape]))
    model.save_pretrained(out, safe_serialization=True)
    return out


def batches(args, vocab: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(0)
    return [[rng.integers(2, vocab, rng.integers(args.min_len, args.max_len + 1)) for _ in range(args.batch)]
            for _ in range(args.batches)]


def run_surge(engine, data):
    from surge.engines.pooling import l2_normalize, pool
    from surge.types import Encoded, TokenBatch

    out = []
    for rows in data:
        batch = TokenBatch.pack([Encoded(r, np.zeros_like(r)) for r in rows])
        out.append(l2_normalize(pool(engine.run(batch), batch, "last")))
    return out


def run_hf(model, data, device):
    out = []
    for rows in data:
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.as_tensor(r)
            mask[i, :len(r)] = 1
        with torch.inference_mode():
            h = model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
            last = h[torch.arange(len(rows), device=device), mask.sum(1).to(device) - 1]
            out.append(torch.nn.functional.normalize(last.float(), dim=-1).cpu().numpy())
    return out


def busy(fn, threads: int):
    """fn() while `threads` Python threads spin (each holds the GIL whenever the interpreter lets it)."""
    import threading

    stop = threading.Event()

    def spin():
        n = 0
        while not stop.is_set():
            n += 1

    pool = [threading.Thread(target=spin) for _ in range(threads)]
    for t in pool:
        t.start()
    try:
        return fn()
    finally:
        stop.set()
        for t in pool:
            t.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-tiny", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default=None, help="fp32 / bf16 (default: bf16 on a GPU, fp32 on the CPU)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--min-len", type=int, default=6)
    ap.add_argument("--max-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy-threads", type=int, default=0,
                    help="also time surge with this many Python threads computing beside it (a busy event loop)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    precision = args.precision or ("bf16" if args.device.startswith("cuda") else "fp32")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    from transformers import AutoModel

    from surge.engines.decoder.embedder import DecoderEmbedder

    with tempfile.TemporaryDirectory() as tmp:
        path = build(args.shape, Path(tmp) / "m")
        engine = DecoderEmbedder(device=args.device, precision=precision, threads=args.threads)
        engine.load(path)
        # the same engine without its CUDA graphs (GPU) / without its TorchScript forward (CPU)
        eager = DecoderEmbedder(device=args.device, precision=precision, threads=args.threads, cuda_graphs=False,
                                cpu_script=False)
        eager.load(path)
        free = DecoderEmbedder(device=args.device, precision=precision, threads=args.threads, batch_invariant=False)
        free.load(path)
        hf = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(args.device).eval()
    data = batches(args, SHAPES[args.shape]["vocab_size"])
    queries = args.batch * args.batches
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    runs = {"surge": lambda: run_surge(engine, data), "transformers": lambda: run_hf(hf, data, args.device)}
    runs["surge, eager"] = lambda: run_surge(eager, data)
    runs["surge, batch_invariant=False"] = lambda: run_surge(free, data)
    engines = {"surge": engine, "surge, eager": eager, "surge, batch_invariant=False": free}
    if args.busy_threads:
        runs[f"surge beside {args.busy_threads} busy Python thread(s)"] = lambda: busy(lambda: run_surge(engine, data),
                                                                                   args.busy_threads)
        runs[f"surge, eager, beside {args.busy_threads} busy Python thread(s)"] = lambda: busy(
            lambda: run_surge(eager, data), args.busy_threads)
    outs = {k: f() for k, f in runs.items()}  # warm-up, and the vectors compared below
    got = {k: [] for k in runs}
    for _ in range(args.rounds):
        for k, f in runs.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            got[k].append(queries / (time.perf_counter() - t0))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(outs["surge"], outs["transformers"]))
    moved = {k: sum(not np.array_equal(run_surge(e, [[row]])[0][0], outs[k][0][i]) for i, row in enumerate(data[0]))
             for k, e in engines.items()}
    outs.clear()
    print(f"\n{args.shape} on {args.device} ({precision}), batches of {args.batch} queries of {args.min_len}-"
          f"{args.max_len} tokens, medians of {args.rounds} rounds; max |surge - transformers| {diff:.2e}")
    print("| engine | queries/s | rounds | vs transformers | moved |\n| --- | ---: | --- | ---: | ---: |")
    base = statistics.median(got["transformers"])
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "max_abs_diff": diff, "rows": {}}
    for k, rounds in got.items():
        med = statistics.median(rounds)
        m = moved.get(k.split(" beside ")[0].rstrip(","))
        result["rows"][k] = {"qps": med, "rounds": rounds, "moved": m}
        shown = "" if m is None else f"{m} of {args.batch}"
        print(f"| {k} | {med:,.0f} | {min(rounds):,.0f}-{max(rounds):,.0f} | {med / base:.2f}x | {shown} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What structured outputs cost: streams held to a JSON schema beside unguided ones, against all unguided,
in the same run.

    python3 benchmarks/guided.py --device cuda --shape qwen2-0.5b --rounds 3
    python3 benchmarks/guided.py --device cpu --shape gpt2-tiny --streams 8 --prompt 32 --output 32

A random-weight model of the shape (benchmarks/generate.py's) with a byte-level BPE tokenizer trained on
the shipped sentences (every byte a token, so JSON can be written; the model's vocabulary padded to the
shape's), served by GenerateService as the HTTP routes call it; `--streams` streams submitted at once,
`--prompt` + `--output` tokens, EOS ignored (a finished grammar then allows only EOS, so every stream
runs its `--output` tokens). Cases: no stream guided, one, all (a JSON array of at least 64 strings:
the grammar never finishes inside the output). Reported: output tokens/s (median of rounds), TTFT and
ITL p50, the ratio to the unguided case, and the host's time in llguidance's mask per guided row and
step (`Guides.masks`, timed around it: all of a step's guided rows in one call).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from benchmarks.generate import SHAPES, build, pct  # noqa: E402

SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 64}


def build_model(shape: str, out: Path, device: str, vocab: int) -> Path:
    from tests.decoder_models import save_tokenizer, train_tokenizer

    tok = train_tokenizer(vocab, all_bytes=True)
    build(shape, out, device)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] >= tok.get_vocab_size(), "the shape's vocabulary must hold the tokenizer's"
    eos = tok.token_to_id("<|im_end|>")
    cfg.update(eos_token_id=eos, bos_token_id=tok.token_to_id("<|endoftext|>"))
    (out / "config.json").write_text(json.dumps(cfg))
    save_tokenizer(tok, out)
    return out


def make_service(path: Path, args):
    from tokenizers import Tokenizer

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerateService, GenerationConfig

    n = args.streams
    max_len = args.prompt + args.output + 16
    gen = GenerationConfig(max_num_seqs=n, max_num_batched_tokens=args.budget, max_model_len=max_len,
                           cache_entries=0, prefix_caching=False)
    engine = DecoderEngine(path, device=args.device, dtype=args.dtype, max_num_seqs=n, max_model_len=max_len,
                           kv_cache_tokens=(n + 8) * max_len, threads=args.threads,
                           decode_steps=gen.decode_steps, decode_launch_ms=gen.decode_launch_ms)
    engine.warmup()
    service = GenerateService("bench", "1", path, engine, Tokenizer.from_file(str(path / "tokenizer.json")), None,
                              gen, request_timeout_s=600)
    service.mark_ready()
    return engine, service


async def one_round(service, prompts, n_out, guided: int) -> dict:
    from surge.runtime.guided import guide_for
    from surge.runtime.scheduler import SamplingParams

    plain = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    held = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True,
                          guide=guide_for("json", SCHEMA, "bench"))
    ttft, itl, counts = [], [], []

    async def one(p, params):
        start = time.perf_counter()
        last, n = None, 0
        async for d in service.stream(p, params, deadline=time.monotonic() + 600):
            now = time.perf_counter()
            (ttft if last is None else itl).append(now - (start if last is None else last))
            last, n = now, n + len(d.token_ids)
        counts.append(n)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p, held if i < guided else plain) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return {"tok_s": sum(counts) / wall, "ttft_p50_ms": 1e3 * pct(ttft, 50), "itl_p50_ms": 1e3 * pct(itl, 50)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--shape", default="qwen2-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=1024, help="the trained tokenizer's vocabulary")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from surge.runtime import guided as guided_mod

    mask_s = [0.0, 0]  # seconds in Guides.masks, rows it computed
    inner = guided_mod.Guides.masks

    def timed_masks(self, matchers):
        t = time.perf_counter()
        try:
            return inner(self, matchers)
        finally:
            mask_s[0] += time.perf_counter() - t
            mask_s[1] += len(matchers)

    guided_mod.Guides.masks = timed_masks
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(args.shape, Path(tmp) / args.shape, "cpu", args.vocab)
        engine, service = make_service(path, args)
        g = torch.Generator().manual_seed(0)
        vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
        prompts = [torch.randint(3, len(vocab), (args.prompt,), generator=g).tolist() for _ in range(args.streams)]
        cases = [("none", 0), ("one", 1), ("all", args.streams)]

        async def run():
            await one_round(service, prompts[:4], 4, 2)  # warm-up: compiles, the tokenizer's trie
            out = {name: [] for name, _ in cases}
            masks = {name: [0.0, 0] for name, _ in cases}
            for _ in range(args.rounds):  # interleaved: a noisy machine hits every case alike
                for name, k in cases:
                    before = list(mask_s)
                    out[name].append(await one_round(service, prompts, args.output, k))
                    masks[name][0] += mask_s[0] - before[0]
                    masks[name][1] += mask_s[1] - before[1]
            await service.close()
            return out, masks

        results, masks = asyncio.run(run())
    base = statistics.median(r["tok_s"] for r in results["none"])
    rows = []
    print(f"\n{args.shape} on {args.device}, {args.streams} streams, {args.prompt} + {args.output} tokens, "
          f"{args.rounds} rounds (medians)\n")
    print("| guided streams | output tok/s | vs none | TTFT p50 ms | ITL p50 ms | masks: us a row and step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, k in cases:
        r = results[name]
        tok_s = statistics.median(x["tok_s"] for x in r)
        m = masks[name]
        row = {"case": name, "guided": k, "tok_s": tok_s, "ratio": tok_s / base,
               "ttft_p50_ms": statistics.median(x["ttft_p50_ms"] for x in r),
               "itl_p50_ms": statistics.median(x["itl_p50_ms"] for x in r),
               "mask_us": 1e6 * m[0] / m[1] if m[1] else None, "rounds_tok_s": [round(x["tok_s"]) for x in r]}
        rows.append(row)
        mask = f"{row['mask_us']:.1f}" if row["mask_us"] else "-"
        print(f"| {k} of {args.streams} | {tok_s:,.0f} | {row['ratio']:.2f}x | {row['ttft_p50_ms']:.1f} | "
              f"{row['itl_p50_ms']:.2f} | {mask} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

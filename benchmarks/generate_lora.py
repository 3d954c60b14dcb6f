"""What serving LoRA adapters costs: one model, its engine without adapter slots against one with them.

    python3 benchmarks/generate_lora.py --device cpu --shape gpt2-small --streams 8 --prompt 64 --output 32 --threads 2
    python3 benchmarks/generate_lora.py --device cuda --shape qwen2-0.5b

The random-weight model of benchmarks/generate.py's shape and `--loras` random PEFT adapters of rank
`--rank` on every projection (written as peft writes them: adapter_config.json + safetensors). Three
rows, their rounds interleaved in one process, each `--streams` greedy streams through
GenerateService.stream (the routes' API) with EOS ignored:

* base: an engine without LoRA slots (on a GPU its fused decode kernels);
* slots, base rows: the same model with `--loras` slots loaded, every request on the base model;
* slots, adapter rows: the same engine, the requests dealt round robin over the adapters (every step
  mixes them);
* on a GPU also: adapter rows with the deltas in two kernels of their own a module (a shrink on a side
  stream, an expand: `lora_join=False`, session 32's form) instead of joined inside the decode GEMMs'
  kernels (kernels/lora_delta.join_deltas), and through the torch form of the deltas (five kernels a
  module), the engine built with `lora_kernel=False`.

Reported: output tokens/s (median of rounds), time per output token p50, and each row against the first.
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from generate import _NoText, build, pct  # noqa: E402


def write_adapter(base: Path, out: Path, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory for every linear projection of `base`, random A and B."""
    from safetensors.torch import save_file

    from surge.models.decoder import load_decoder_config
    from surge.models.lora import in_features, modules_of, part_rows

    cfg = load_decoder_config(base)
    g = torch.Generator().manual_seed(seed)
    tensors, targets = {}, set()
    prefix = "base_model.model.transformer.h" if cfg.arch == "gpt2" else "base_model.model.model.layers"
    place = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "c_attn": "attn", "c_fc": "mlp"}
    for layer in range(cfg.num_layers):
        for module, parts in modules_of(cfg).items():
            for part, rows in zip(parts, part_rows(cfg, module)):
                path = part if "." in part else f"{place[part]}.{part}"
                key = f"{prefix}.{layer}.{path}"
                k = in_features(cfg, module)
                tensors[key + ".lora_A.weight"] = torch.randn(rank, k, generator=g) / k ** 0.5
                tensors[key + ".lora_B.weight"] = torch.randn(rows, rank, generator=g) / rank ** 0.5 * 0.1
                targets.add(part.rsplit(".", 1)[-1])
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(targets),
        "bias": "none", "base_model_name_or_path": str(base)}))
    return out


def make(path: Path, args, n: int, loras: int, lora_kernel: bool | None = None, lora_join: bool = True):
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerateService, GenerationConfig

    max_len = args.prompt + args.output + 16
    gen = GenerationConfig(max_num_seqs=n, max_num_batched_tokens=args.budget, max_model_len=max_len, cache_entries=0,
                           prefix_caching=False, max_loras=loras, max_lora_rank=args.rank)
    engine = DecoderEngine(path, device=args.device, dtype=args.dtype, max_num_seqs=n, max_model_len=max_len,
                           kv_cache_tokens=(n + 8) * max_len, threads=args.threads, decode_steps=gen.decode_steps,
                           decode_launch_ms=gen.decode_launch_ms, max_loras=loras, max_lora_rank=args.rank,
                           lora_kernel=lora_kernel, lora_join=lora_join)
    engine.warmup()
    service = GenerateService("bench", "1", path, engine, _NoText(), None, gen, request_timeout_s=600)
    service.mark_ready()
    return service


async def one_round(service, prompts, n_out, adapters):
    from surge.runtime.scheduler import SamplingParams

    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    tpot, counts = [], []

    async def one(i, p):
        first = last = None
        n = 0
        adapter = adapters[i % len(adapters)] if adapters else None
        async for d in service.stream(p, params, deadline=time.monotonic() + 600, adapter=adapter):
            last = time.perf_counter()
            first = first or last
            n += len(d.token_ids)
        counts.append(n)
        if n > 1:
            tpot.append((last - first) / (n - 1))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    return {"tok_s": sum(counts) / wall, "tpot_p50_ms": 1e3 * pct(tpot, 50)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="gpt2-small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--loras", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        base = build(args.shape, Path(tmp) / "model", "cpu")
        names = [f"lora{i}" for i in range(args.loras)]
        plain = make(base, args, args.streams, 0)
        slots = make(base, args, args.streams, args.loras)
        services = [plain, slots]
        if slots.engine.lora.kernel:
            services.append(make(base, args, args.streams, args.loras, lora_join=False))
            services.append(make(base, args, args.streams, args.loras, lora_kernel=False))
        for i, name in enumerate(names):
            path = write_adapter(base, Path(tmp) / name, args.rank, seed=i)
            for service in services[1:]:
                service.add_adapter(name, path)
        g = torch.Generator().manual_seed(0)
        vocab = plain.vocab_size
        prompts = [torch.randint(2, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.streams)]
        rows = {"base (no slots)": (plain, None), "slots, base rows": (slots, None),
                "slots, adapter rows": (slots, names)}
        if len(services) > 2:
            rows["slots, adapter rows, two delta kernels"] = (services[2], names)
            rows["slots, adapter rows, torch form"] = (services[3], names)

        async def run():
            for service, adapters in rows.values():  # warm-up (compiles, first allocations)
                await one_round(service, prompts[:4], 4, adapters)
            got = {k: [] for k in rows}
            for _ in range(args.rounds):
                for k, (service, adapters) in rows.items():
                    got[k].append(await one_round(service, prompts, args.output, adapters))
                    print(f"  {k}: {got[k][-1]['tok_s']:.0f} tok/s", flush=True)
            for service in services:
                await service.close()
            return got

        got = asyncio.run(run())
    first = None
    print(f"\n{args.shape} on {args.device}, {args.streams} streams, {args.prompt} + {args.output} tokens, "
          f"{args.loras} adapters of rank {args.rank}, medians of {args.rounds} rounds")
    print("| row | output tok/s | vs base | time per token p50 ms |\n| --- | ---: | ---: | ---: |")
    out = {"args": vars(args) | {"json": str(args.json)}, "rows": {}}
    for k, rounds in got.items():
        tok_s = statistics.median(r["tok_s"] for r in rounds)
        tpot = statistics.median(r["tpot_p50_ms"] for r in rounds)
        first = first or tok_s
        out["rows"][k] = {"tok_s": tok_s, "tpot_p50_ms": tpot, "rounds": rounds}
        print(f"| {k} | {tok_s:,.0f} | {tok_s / first:.2f}x | {tpot:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

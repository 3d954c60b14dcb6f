"""Generation throughput and latency: surge's decoder service against transformers' generate.

    python3 benchmarks/generate.py --device cuda --shape qwen2-0.5b --shape llama-1b
    python3 benchmarks/generate.py --device cpu --shape gpt2-small --streams 8 --prompt 64 --output 32

For each shape a random-weight model of that shape is built with transformers and saved
(safetensors), then:

* surge: `--streams` concurrent streams through GenerateService.stream (the API the HTTP
  routes call: iteration scheduler, paged KV cache, chunked prefill, CUDA-graph decode), all
  submitted at once, each a `--prompt`-token random prompt generating `--output` tokens with
  EOS ignored. Token ids in, token ids out: detokenization is left out (the model has no real
  tokenizer), as in vLLM's throughput benchmark. Reported: output tokens/s over the wall time,
  time to first token (TTFT) and inter-token latency (ITL) p50/p99 over all streams.
* transformers: `generate` on one padded batch of the same prompts with a static cache
  (greedy, `min_new_tokens` = `max_new_tokens`), eager and, with --compile, torch.compile'd
  (transformers' own auto-compile of static-cache decoding). TTFT: a generate of one token;
  ITL: (total - TTFT) / (output - 1).

The table and a JSON record are printed; --json writes the records to a file.
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

SHAPES = {
    # Qwen2-0.5B: 24 layers, 896 hidden, 14 q / 2 kv heads, 4864 FFN, 151936 vocab, tied embeddings
    "qwen2-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                 max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6)),
    # Llama-3.2-1B: 16 layers, 2048 hidden, 32 q / 8 kv heads, 8192 FFN, 128256 vocab, llama3 RoPE
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=4096, tie_word_embeddings=True,
                               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                               rope_theta=500000.0)),
    # Llama-3-8B: 32 layers, 4096 hidden, 32 q / 8 kv heads, 14336 FFN, 128256 vocab (untied)
    "llama-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=500000.0)),
    # GPT-2 small (124M)
    "gpt2-small": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)),
    "gpt2-tiny": ("gpt2", dict(n_embd=128, n_layer=2, n_head=4, n_positions=512, vocab_size=1000)),
}


def build(shape: str, out: Path, device: str) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kind, kw = SHAPES[shape]
    cfg_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
                          "gpt2": (GPT2Config, GPT2LMHeadModel)}[kind]
    cfg = cfg_cls(bos_token_id=0, eos_token_id=1, pad_token_id=0, **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(cfg)
    if sum(p.numel() for p in model.parameters()) > 2e9:  # an 8B model: BF16 on disk (half the bytes to write)
        model = model.to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def use_splitk_plans(path: Path) -> dict:
    """Replace the measured split-K table (engines/kernels/splitk_gemm.PLANS) with the plans a tuning
    run wrote (benchmarks/gpu_splitk_tune.py --json: {"plans": {"NxK": [BN, BK, splits, warps, stages,
    swap]}}), so one device call can tune and then measure end to end."""
    from surge.engines.kernels import splitk_gemm as sk

    plans = json.loads(Path(path).read_text())["plans"]
    sk.PLANS.clear()
    for key, p in plans.items():
        n, k = (int(x) for x in key.split("x"))
        sk.PLANS[(n, k)] = sk.SplitKPlan(*p)
    print(f"split-K plans from {path}: {sk.PLANS}", flush=True)
    return dict(sk.PLANS)


class _NoText:
    """Token ids only: the benchmark measures generation, not detokenization."""

    def decode(self, ids, skip_special_tokens=True):
        return ""

    def encode(self, text, add_special_tokens=True):
        raise NotImplementedError


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


async def _surge_round(service, prompts, n_out):
    from surge.runtime.scheduler import SamplingParams

    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    ttft, itl, tpot, counts = [], [], [], []

    async def one(p):
        start = time.perf_counter()
        first = last = None
        n = 0
        async for d in service.stream(p, params, deadline=time.monotonic() + 600):
            now = time.perf_counter()
            if last is None:
                ttft.append(now - start)
                first = now
            else:
                itl.append(now - last)
            last = now
            n += len(d.token_ids)
        counts.append(n)
        if n > 1:  # time per output token after the first: what transformers' row reports as ITL
            tpot.append((last - first) / (n - 1))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    return {"output_tokens": sum(counts), "wall_s": wall, "tok_s": sum(counts) / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
            "tpot_p50_ms": 1e3 * pct(tpot, 50) if tpot else float("nan")}


def make_service(path: Path, args, n: int, fused: bool = True, overlap: bool = True, speculative: int = 0,
                 quantization: str = "none", process: bool = False, layout: str = "auto"):
    """The decoder engine (warmed up) and the service the benchmark drives, for n streams of
    args.prompt + args.output tokens: (engine, service, load seconds). process: the engine loop in a process
    of its own (runtime/generate_process.EngineProcess, what `surge serve` runs by default), the service here."""
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerateService, GenerationConfig

    max_len = args.prompt + args.output + 16
    steps = getattr(args, "decode_steps", None) or GenerationConfig().decode_steps
    rows = getattr(args, "graph_prefill_tokens", None)
    rows = GenerationConfig().graph_prefill_tokens if rows is None else rows
    gen = GenerationConfig(max_num_seqs=max(n, 1), max_num_batched_tokens=args.budget, max_model_len=max_len,
                           cache_entries=0, prefix_caching=bool(getattr(args, "prefix_caching", False)),
                           overlap_steps=overlap, prefill_beside=getattr(args, "prefill_beside", True),
                           overlap_depth=args.overlap_depth, decode_steps=steps, speculative_tokens=speculative,
                           **({"speculative_max_batch": args.speculative_max_batch}
                              if getattr(args, "speculative_max_batch", None) else {}))
    t = time.perf_counter()
    kw = dict(device=args.device, dtype=args.dtype, max_num_seqs=gen.max_num_seqs, max_model_len=max_len,
              kv_cache_tokens=(n + 8) * max_len, cuda_graphs=not args.no_graphs, fused=fused,
              decode_gemm=args.decode_gemm, decode_attention=args.decode_attention, pdl=not args.no_pdl,
              decode_steps=steps, decode_launch_ms=gen.decode_launch_ms, speculative_tokens=speculative,
              graph_prefill_tokens=rows,
              quantization=quantization.removesuffix("-weight-only"), cpu_weight_layout=layout,
              fp8_activations=not quantization.endswith("-weight-only"),
              **({"beside_priority": args.beside_priority} if getattr(args, "beside_priority", None) is not None else {}))
    if process:
        from surge.runtime.generate_process import EngineProcess

        engine = EngineProcess(path, kw, gen.resolved(), "bench", threads=args.threads)
    else:
        engine = DecoderEngine(path, threads=args.threads, **kw)
        engine.warmup()
    load_s = time.perf_counter() - t
    service = GenerateService("bench", "1", path, engine, _NoText(), None, gen, request_timeout_s=600)
    service.mark_ready()
    return engine, service, load_s


def run_surge(path: Path, args, prompts, fused: bool = True, overlap: bool = True, speculative: int = 0,
              quantization: str = "none", process: bool = False, layout: str = "auto") -> dict:
    n = len(prompts)
    engine, service, load_s = make_service(path, args, n, fused, overlap, speculative, quantization, process,
                                           layout)
    if process:
        return _run_remote(service, args, prompts, load_s)

    async def main():
        # warm-up round (Triton compiles the prefill variants), then the measured rounds
        await _surge_round(service, prompts[: min(n, 8)], 4)
        rounds = [await _surge_round(service, prompts, args.output) for _ in range(args.rounds)]
        prof = None
        if args.profile and args.device.startswith("cuda"):
            prof = await _profiled_round(service, prompts, args.output)
        await service.close()
        return rounds, prof

    rounds, prof = asyncio.run(main())
    restored_us = graph_replay_us(engine, restore=True)
    decode_us = graph_replay_us(engine)
    best = max(rounds, key=lambda r: r["tok_s"])
    best["rounds_tok_s"] = [round(r["tok_s"], 1) for r in rounds]
    best["median_tok_s"] = statistics.median(r["tok_s"] for r in rounds)
    best["overlap"] = overlap
    best["decode_steps"] = service.config.decode_steps
    if engine.graphs is not None and engine.graphs.step_us:  # what a launch of the n streams runs
        best["step_us"] = engine.graphs.step_us
        best["launch_steps"] = engine.steps_for(n)
    best["overlapped_steps"] = service.loop.overlapped
    if speculative:  # n-gram speculation: how often the drafts were right, what a step of draft rows costs
        loop = service.loop
        best.update(speculative_tokens=speculative, spec_steps=loop.spec_steps, draft_tokens=loop.drafted,
                    accepted_tokens=loop.accepted, acceptance=loop.accepted / max(1, loop.drafted))
        sg = engine.row_graphs.graphs if engine.row_graphs is not None else {}
        if sg:
            rows = next(b for b in sorted(sg) if b >= n * (speculative + 1)) if max(sg) >= n * (speculative + 1) \
                else max(sg)
            best["spec_graph_replay_us"] = {rows: replay_us(sg[rows])}
    if prof:
        best["profile"] = prof
    best["load_s"] = load_s
    if getattr(getattr(engine, "model", None), "cpu_layout", None):  # what cpu_weight_layout kept
        best["cpu_layout"] = engine.model.cpu_layout
    best["graph_replay_us"] = decode_us
    best["graph_replay_restored_us"] = restored_us
    best["steps"] = service.steps
    best["engine_busy_s"] = round(service.busy_s, 3)
    best["fused"] = fused
    best["decode_gemm"] = args.decode_gemm
    best["splitk_gemms"] = len(getattr(engine.model, "_splitk", {}))
    return best


def _run_remote(service, args, prompts, load_s) -> dict:
    """run_surge's rounds on a service whose engine loop runs in its own process (no graph timings here)."""
    n = len(prompts)

    async def main():
        await _surge_round(service, prompts[: min(n, 8)], 4)
        rounds = [await _surge_round(service, prompts, args.output) for _ in range(args.rounds)]
        steps, busy = service.steps, service.busy_s
        await service.close()
        return rounds, steps, busy

    rounds, steps, busy = asyncio.run(main())
    best = max(rounds, key=lambda r: r["tok_s"])
    best.update(rounds_tok_s=[round(r["tok_s"], 1) for r in rounds],
                median_tok_s=statistics.median(r["tok_s"] for r in rounds), load_s=load_s, steps=steps,
                engine_busy_s=round(busy, 3), engine="process")
    return best


def graph_replay_us(engine, restore: bool | None = None) -> float | None:
    """The largest bucket's decode graph replayed alone (50 back to back, median of 5): the GPU's time
    for one decode step, launch gaps inside the graph included (the buffers hold the last step's).
    `restore` copies the staged inputs back before each replay (one small device copy, in the time), so
    that every replay is the same step; graphs captured for multi-step launches are always timed so:
    they move their inputs on a position each replay, and 250 replays would run past the block tables
    and the RoPE tables (session 25's call 2 read out of bounds that way)."""
    graphs = engine.graphs.graphs if engine.graphs is not None else {}
    if not graphs:
        return None
    if restore is None:
        restore = engine.graphs.steps > 1
    if not restore:
        return replay_us(graphs[max(graphs)])
    packed = engine.graphs.packed
    saved = packed.clone()
    us = replay_us(graphs[max(graphs)], before=lambda: packed.copy_(saved))
    packed.copy_(saved)
    return us


def replay_us(g, repeats: int = 5, before=None) -> float:
    """A captured CUDA graph replayed 50 times back to back (`before()` queued ahead of each replay): the
    median over `repeats` of the mean replay, in us."""
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        for _ in range(50):
            if before is not None:
                before()
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 50 * 1e3)
    return statistics.median(times)


async def _profiled_round(service, prompts, n_out) -> dict:
    """One more round under torch.profiler: device (kernel) time against wall time, per step; the
    difference is the device idling while the host schedules, reads back and hands out tokens."""
    from torch.profiler import ProfilerActivity, profile

    steps0 = service.steps
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = await _surge_round(service, prompts, n_out)
        torch.cuda.synchronize()
    steps = service.steps - steps0
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_us = sum(e.device_time for e in events) if events and hasattr(events[0], "device_time") else \
        sum(e.cuda_time for e in events)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70)
    print(table, flush=True)
    # the prefill step: the largest gap-free span is hard to get from key_averages; report its kernels
    return {"steps": steps, "wall_ms": 1e3 * r["wall_s"], "kernel_ms": kernel_us / 1e3,
            "wall_per_step_ms": 1e3 * r["wall_s"] / max(1, steps),
            "kernel_per_step_ms": kernel_us / 1e3 / max(1, steps),
            "ttft_p50_ms": r["ttft_p50_ms"], "itl_p50_ms": r["itl_p50_ms"], "tok_s": r["tok_s"]}


def run_hf(path: Path, args, prompts, compile_: bool) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device).eval()
    ids = torch.tensor(prompts, device=args.device)  # equal lengths: the padded batch has no padding
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, cache_implementation="static", pad_token_id=0, eos_token_id=None,
              disable_compile=not compile_)

    def gen(n):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **kw)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t

    t = time.perf_counter()
    gen(args.output)  # warm-up (and compilation)
    warm_s = time.perf_counter() - t
    ttft = min(gen(1) for _ in range(2))
    totals = [gen(args.output) for _ in range(args.rounds)]
    total = min(totals)
    median_total = statistics.median(totals)
    out = len(prompts) * args.output
    return {"output_tokens": out, "wall_s": total, "tok_s": out / total, "ttft_p50_ms": 1e3 * ttft,
            "ttft_p99_ms": 1e3 * ttft, "itl_p50_ms": 1e3 * (total - ttft) / max(1, args.output - 1),
            "itl_p99_ms": float("nan"), "warmup_s": warm_s, "rounds_tok_s": [round(out / x, 1) for x in totals],
            "median_tok_s": out / median_total, "compile": compile_}


def add_engine_args(ap: argparse.ArgumentParser, budget: int = 2048) -> None:
    """The workload's and the engine's options, shared with generate_timeline.py (make_service reads them)."""
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="bf16 (GPU default) | fp32 (CPU default) | fp16")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--budget", type=int, default=budget, help="token budget of one step (chunked prefill)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--decode-gemm", choices=["auto", "splitk", "cublas"], default="auto",
                    help="the decode step's layer GEMMs: measured split-K plans where they beat cuBLAS (auto), "
                         "split-K everywhere, or cuBLAS only")
    ap.add_argument("--decode-attention", choices=["fused", "split"], default="fused",
                    help="decode steps: RoPE + cache write + attention in one kernel, or two (session 8)")
    ap.add_argument("--overlap-depth", type=int, default=2, help="launched decode steps in flight (1-3)")
    ap.add_argument("--no-pdl", action="store_true", help="plain launches of the decode kernels (no PDL)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="greedy decode steps a launch (GenerationConfig.decode_steps, whose default it takes)")
    ap.add_argument("--graph-prefill-tokens", type=int, default=None,
                    help="steps of at most this many tokens replay CUDA graphs (GenerationConfig."
                         "graph_prefill_tokens, whose default it takes; 0: eager)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-fused", action="store_true", help="plain torch norms / RoPE / SwiGLU on the GPU")
    ap.add_argument("--splitk-plans", type=Path, help="the split-K table from a gpu_splitk_tune.py --json run")
    ap.add_argument("--baseline", choices=["hf", "none"], default="hf")
    ap.add_argument("--compile", action="store_true", help="also transformers with torch.compile")
    ap.add_argument("--only-compile", action="store_true", help="transformers with torch.compile only")
    ap.add_argument("--sync", action="store_true", help="also surge with synchronous steps (overlap off)")
    ap.add_argument("--speculative-tokens", type=int, default=0,
                    help="also surge with n-gram speculative decoding checking up to this many drafts a step")
    ap.add_argument("--speculative-max-batch", type=int, default=None,
                    help="speculate only in steps of at most this many sequences (default: the setting's default)")
    ap.add_argument("--profile", action="store_true", help="one more surge round under torch.profiler")
    ap.add_argument("--quantization", action="append", choices=["fp8", "fp8-weight-only", "int8", "w8a8"], default=[],
                    help="also surge with 8-bit weights (--generation quantization=fp8 / int8 on a GPU; "
                         "fp8-weight-only: fp8 with fp8_activations=false; w8a8: INT8 products on the CPU); repeatable")
    ap.add_argument("--cpu-weight-layout", action="append", choices=["in_out", "out_in"], default=[],
                    help="also surge with the CPU's linear weights pinned to this layout (the first row measures "
                         "both at load: cpu_weight_layout=auto); repeatable")
    ap.add_argument("--engine", choices=["thread", "process", "both"], default="thread",
                    help="surge's engine loop on a thread of this process (the rows so far), in a process of its own "
                         "(what `surge serve` runs by default), or both rows in one run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.threads and not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    if args.splitk_plans:
        use_splitk_plans(args.splitk_plans)
    shapes = args.shape or (["qwen2-0.5b"] if args.device.startswith("cuda") else ["gpt2-small"])
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            path = build(shape, Path(tmp) / shape, args.device)
            vocab = SHAPES[shape][1].get("vocab_size", 1000)
            g = torch.Generator().manual_seed(1)
            prompts = torch.randint(2, vocab, (args.streams, args.prompt), generator=g).tolist()
            rows = []
            if not args.only_compile:
                if args.engine != "process":
                    try:
                        rows = [("surge", run_surge(path, args, prompts, fused=not args.no_fused))]
                    except Exception as exc:  # the fused kernels failed here: say so, measure without them
                        print(f"surge with fused kernels failed: {type(exc).__name__}: {exc}", flush=True)
                        rows = [("surge (unfused)", run_surge(path, args, prompts, fused=False))]
                if args.engine != "thread":
                    rows.append(("surge, engine process", run_surge(path, args, prompts, not args.no_fused,
                                                                    process=True)))
                if args.sync:
                    rows.append(("surge, synchronous steps", run_surge(path, args, prompts, not args.no_fused, False)))
                if args.speculative_tokens:
                    rows.append((f"surge, n-gram speculation (k={args.speculative_tokens})",
                                 run_surge(path, args, prompts, not args.no_fused,
                                           speculative=args.speculative_tokens)))
                for layout in args.cpu_weight_layout:
                    rows.append((f"surge, weights {layout}", run_surge(path, args, prompts, not args.no_fused,
                                                                       layout=layout)))
                for quant in args.quantization:
                    rows.append((f"surge, {quant} weights", run_surge(path, args, prompts, not args.no_fused,
                                                                      quantization=quant)))
            if args.baseline == "hf" and not args.only_compile:
                rows.append(("transformers static", run_hf(path, args, prompts, False)))
            if args.baseline == "hf" and (args.compile or args.only_compile):
                try:
                    rows.append(("transformers static+compile", run_hf(path, args, prompts, True)))
                except Exception as exc:  # reported, not fatal
                    import traceback

                    traceback.print_exc()
                    print(f"torch.compile baseline failed: {type(exc).__name__}: {exc}", flush=True)
            hf = next((r for name, r in rows if name == "transformers static"), None)
            print(f"\n{shape} ({args.device}, {args.dtype}): {args.streams} streams, {args.prompt}-token prompts, "
                  f"{args.output} output tokens; best round, median of {args.rounds} rounds")
            print("| engine | output tok/s best / median | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
                  "vs transformers: best/best, median/median, per-round range |")
            print("| --- | --- | --- | --- | --- |")
            for name, r in rows:
                ratio = "-"
                if hf:
                    lo = min(r["rounds_tok_s"]) / max(hf["rounds_tok_s"])
                    hi = max(r["rounds_tok_s"]) / min(hf["rounds_tok_s"])
                    ratio = (f"{r['tok_s'] / hf['tok_s']:.2f}x, {r['median_tok_s'] / hf['median_tok_s']:.2f}x, "
                             f"{lo:.2f}-{hi:.2f}x")
                print(f"| {name} | {r['tok_s']:.0f} / {r['median_tok_s']:.0f} | {r['ttft_p50_ms']:.1f} / "
                      f"{r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | {ratio} |")
                if r.get("cpu_layout"):
                    print(f"  {name}: linear weights {r['cpu_layout']['layers']}, LM head {r['cpu_layout']['lm_head']}")
                if r.get("launch_steps") is not None:
                    print(f"  {name}: {r['launch_steps']} decode steps a launch (decode_steps {r['decode_steps']}, "
                          f"capped by decode_launch_ms at the bucket's measured step)")
                if name != rows[0][0] and name.startswith("surge"):
                    first = rows[0][1]["median_tok_s"]
                    print(f"  {name} against {rows[0][0]} (same run): median {r['median_tok_s'] / first:.2f}x")
                if r.get("tpot_p50_ms") is not None and name.startswith("surge"):
                    print(f"  {name}: time per output token after the first, p50 of the streams "
                          f"{r['tpot_p50_ms']:.3f} ms (ITL above: the gap between deliveries)")
                if r.get("speculative_tokens"):
                    print(f"  {name}: {r['spec_steps']} speculative steps, {r['draft_tokens']} drafts checked, "
                          f"{r['accepted_tokens']} accepted ({100 * r['acceptance']:.0f}%); a step of draft rows "
                          f"replayed alone {r.get('spec_graph_replay_us')} us (rows: us)")
                if r.get("graph_replay_us"):
                    print(f"  {name}: the largest bucket's decode graph replayed alone "
                          f"{r['graph_replay_us']:.1f} us a step ({r['graph_replay_restored_us']:.1f} with its "
                          f"inputs restored each replay); rounds tok/s {r['rounds_tok_s']}; "
                          f"decode_gemm {r.get('decode_gemm')} ({r.get('splitk_gemms')} split-K GEMMs)")
                records.append({"shape": shape, "engine": name, "device": args.device, "dtype": args.dtype,
                                "streams": args.streams, "prompt": args.prompt, "output": args.output, **r})
            print(json.dumps(records[-len(rows):]), flush=True)
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

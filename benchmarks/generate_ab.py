"""Decode-step variants of surge's generation, interleaved in one process (issue 18, session 7).

One random-weight model of the shape (as benchmarks/generate.py builds it); one DecoderEngine +
GenerateService per variant, all loaded at once; then rounds of `--streams` streams (the generate.py
round: all submitted at once, `--prompt` tokens in, `--output` out, EOS ignored) run variant after
variant, the order rotated every round, so that each variant's rounds are spread over the same minutes.
Reported per variant: median output tok/s, ITL p50, TTFT p50 and the round's wall time, then one
round under torch.profiler: kernel time per step by kind (prefill included), and the bucket's CUDA
graph replayed alone (50 back to back, median of 5; the buffers hold the last step's, ~255 tokens of
context): the GPU's time for one decode step, launch gaps inside the graph included.

    PYTHONPATH=src python3 benchmarks/generate_ab.py --rounds 9 --variants base,argmax,argmax+attn128

Variants (comma-separated, each a '+'-joined list of options on top of session 2's engine):
  base       session 2: FP32 logits in the graph, 64 keys per attention iteration, cuBLAS
  argmax     the greedy argmax on the BF16 logits (no FP32 cast in the graph)
  attn128 / attn256  128 / 256 keys per paged-attention iteration in decode steps
  targmax    the argmax by a two-pass Triton kernel (kernels/decoder_fused.argmax_rows)
  lt         cuBLASLt as torch's preferred BLAS while the variant captures and runs
  sk         the layer GEMMs of decode steps through split-K where the table has a plan (session 8;
             decode_gemm="auto"; --splitk-plans replaces the table), cuBLAS otherwise
  skall      split-K for every layer GEMM of decode steps (decode_gemm="splitk")
  fa         RoPE, the K/V cache write and attention in one kernel in decode steps (session 10;
             decode_attention="fused"; without it "split", the two kernels of session 8)
  pdl        programmatic dependent launch of the fused path's Triton kernels (session 10)
  d1 / d3    1 / 3 launched decode steps in flight before the oldest is read back (default 2; session 9
             and before: 1)
  ta         the one-kernel attention launched with --attn-launch's warps and stages (session 10)
  l2kv       the one-kernel attention's first key tile asked into L2 before the PDL wait (session 21,
             decode_attention.PREFETCH_FIRST_TILE)
  pf         each layer's weights asked into L2 from a side stream a phase ahead (session 12;
             kernels/l2_prefetch.py: the MLP's at the layer's start, the next layer's attention
             weights at the MLP's start)
  pfs        the same, staggered: gate/up at the layer's start; down and the next layer's qkv and o at
             the MLP's start
  gu         SiLU(gate) * up in one Triton kernel at decode sizes (kernels/gate_up.py) with the plan of
             --gate-up-plan (session 10); without it cuBLAS + silu_mul
  tma        the measured TMA plans (session 18: gate/up with gu, the o and down split-K GEMMs with sk),
             their operands read by TMA; without it the pointer-load plans of sessions 8 and 10
  msN        multi-step launches: N greedy decode steps a launch, each step's inputs made on the device
             (session 25; GenerationConfig.decode_steps); without it one step a launch

`--busy-threads N`: after the measured rounds, as many again with N Python threads computing in the
process (each holding the GIL as a busy server's request handling would), reported as rows of their
own: what a host that cannot keep up with the device step costs each variant.
The session-7 engine (the defaults before session 8) is argmax+attn256+targmax.
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


def engine_kwargs(variant: str) -> tuple[dict, bool]:
    opts = set(variant.split("+"))
    kw = dict(graph_fp32_logits="argmax" not in opts, decode_block_n=64, argmax_kernel="torch",
              decode_gemm="splitk" if "skall" in opts else "auto" if "sk" in opts else "cublas",
              decode_attention="fused" if "fa" in opts else "split", pdl="pdl" in opts,
              l2_prefetch="staggered" if "pfs" in opts else "pf" in opts)
    for o in opts:
        if o.startswith("attn"):
            kw["decode_block_n"] = int(o[4:])
    if "targmax" in opts:
        kw["argmax_kernel"] = "triton"
    return kw, "lt" in opts


# The modules' own tables (gate/up, split-K: session 18's TMA plans), and the split-K table of the variants
# without "tma" (the pointer-load plans, or a --splitk-plans table); set by main before any variant.
TMA_PLANS: tuple[dict, dict] = ({}, {})
POINTER_SPLITK: dict = {}


def gate_up_plan(spec: str):
    """--gate-up-plan: "BLOCK_N,BLOCK_K,num_warps,num_stages,swap[,tma]", or a gpu_gate_up_tune.py --json
    file (its "best" plan; None where cuBLAS + silu_mul won)."""
    from surge.engines.kernels.gate_up import GateUpPlan

    if Path(spec).is_file():
        best = json.loads(Path(spec).read_text())["best"]
        return GateUpPlan(*best) if best else None
    bn, bk, nw, st, sw, *tm = spec.split(",")
    return GateUpPlan(int(bn), int(bk), int(nw), int(st), sw.lower() == "true", bool(tm) and tm[0].lower() == "true")


def use_gate_up(variant: str, plan, key: tuple[int, int]) -> None:
    """The gate/up and split-K plan tables the next engine is built with: for a "gu" variant the module's
    TMA plan for key = (intermediate, hidden) with "tma" where it has one, else `plan` (--gate-up-plan);
    none without "gu" (cuBLAS + silu_mul); the split-K table with TMA plans for a "tma" variant, the
    pointer-load table otherwise (a --splitk-plans table replaces it). Engines resolve their plans when
    constructed."""
    from surge.engines.kernels import gate_up

    from surge.engines.kernels import splitk_gemm

    opts = variant.split("+")
    gate_up.PLANS.clear()
    if "gu" in opts and "tma" in opts and key in TMA_PLANS[0]:
        gate_up.PLANS[key] = TMA_PLANS[0][key]
    elif "gu" in opts and plan is not None:
        gate_up.PLANS[key] = plan
    splitk_gemm.PLANS.clear()
    splitk_gemm.PLANS.update(TMA_PLANS[1] if "tma" in opts else POINTER_SPLITK)


def use_attn_launch(variant: str, launch: str) -> None:
    """The decode attention's launch shape for the next engine: --attn-launch for a "ta" variant, else
    session 10's first form (4 warps, 2 stages); the first key tile asked into L2 before the PDL wait for an
    "l2kv" variant. Captured into the engine's graphs when it is built."""
    from surge.engines.kernels import decode_attention

    warps, stages = (launch.split(",") if "ta" in variant.split("+") else ("4", "2"))
    decode_attention.LAUNCH.update(num_warps=int(warps), num_stages=int(stages))
    decode_attention.PREFETCH_FIRST_TILE = "l2kv" in variant.split("+")


def blas(lt: bool) -> None:
    torch.backends.cuda.preferred_blas_library("cublaslt" if lt else "cublas")


def busy_threads(n: int):
    """n daemon threads running pure-Python arithmetic until the returned event is set: each holds the
    GIL for the interpreter's switch interval at a time, as request handling in a busy server does."""
    import threading

    stop = threading.Event()

    def spin():
        x = 0
        while not stop.is_set():
            for i in range(2000):
                x = (x * 31 + i) % 1000003

    for _ in range(n):
        threading.Thread(target=spin, daemon=True).start()
    return stop


def kind(name: str) -> str:
    n = name.lower()
    for key, label in (("_partials", "split-K GEMM"), ("decode_attn", "rope+cache+attention"),
                       ("_gate_up", "gate_up+silu"), ("paged_attn", "paged attention"), ("add_rmsnorm", "add_rmsnorm"),
                       ("rope_cache", "rope+cache"), ("silu_mul", "silu_mul"), ("argmax", "argmax"),
                       ("memcpy", "memcpy"), ("memset", "memset")):
        if key in n:
            return label
    if "reduce" in n and "gemm" not in n and "splitk" not in n:
        return "reduce (argmax, ...)"
    if any(k in n for k in ("gemm", "nvjet", "cutlass", "sm90", "xmma", "splitk", "cublas")):
        return "GEMM"
    if "elementwise" in n or "copy" in n or "cast" in n:
        return "elementwise / copy"
    return "other: " + name[:60]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2-0.5b")
    ap.add_argument("--variants", default="base,argmax")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--attn-launch", default="4,2", help="num_warps,num_stages of the ta variants")
    ap.add_argument("--busy-threads", type=int, default=0,
                    help="also rounds with this many Python threads computing (a busy host)")
    ap.add_argument("--gate-up-plan", default="32,128,4,3,false",
                    help="BLOCK_N,BLOCK_K,num_warps,num_stages,swap[,tma] of the gu variants, or a "
                         "gpu_gate_up_tune.py --json file")
    ap.add_argument("--settle", action="store_true", help="gc_settle.settle() after the warm-up (as the server)")
    ap.add_argument("--splitk-plans", type=Path, help="the split-K table from a gpu_splitk_tune.py --json run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from benchmarks.generate import SHAPES, _NoText, _surge_round, build, graph_replay_us, use_splitk_plans

    from surge.engines.kernels import gate_up, splitk_gemm

    TMA_PLANS[0].update(gate_up.PLANS)
    TMA_PLANS[1].update(splitk_gemm.PLANS)
    POINTER_SPLITK.update(use_splitk_plans(args.splitk_plans) if args.splitk_plans else splitk_gemm.POINTER_PLANS)
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerateService, GenerationConfig

    variants = args.variants.split(",")
    n = args.streams
    max_len = args.prompt + args.output + 16
    services = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build(args.shape, Path(tmp) / args.shape, "cuda")
        cfg = SHAPES[args.shape][1]
        vocab = cfg["vocab_size"]
        gu_key, gu_plan = (cfg["intermediate_size"], cfg["hidden_size"]), gate_up_plan(args.gate_up_plan)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(2, vocab, (n, args.prompt), generator=g).tolist()
        for v in variants:
            kw, lt = engine_kwargs(v)
            blas(lt)
            use_gate_up(v, gu_plan, gu_key)
            use_attn_launch(v, args.attn_launch)
            depth = next((int(o[1:]) for o in v.split("+") if o in ("d1", "d2", "d3")), 2)
            steps = next((int(o[2:]) for o in v.split("+") if o.startswith("ms") and o[2:].isdigit()), 1)
            gen = GenerationConfig(max_num_seqs=n, max_num_batched_tokens=args.budget, max_model_len=max_len,
                                   cache_entries=0, prefix_caching=False, overlap_steps=True, overlap_depth=depth,
                                   decode_steps=steps)
            t = time.perf_counter()
            try:
                engine = DecoderEngine(path, device="cuda", dtype="bf16", max_num_seqs=n, max_model_len=max_len,
                                       kv_cache_tokens=(n + 8) * max_len, decode_steps=steps,
                                       decode_launch_ms=gen.decode_launch_ms, **kw)
                engine.warmup()
            except Exception as exc:  # a variant that fails is reported and left out
                import traceback

                traceback.print_exc()
                print(f"variant {v} failed: {type(exc).__name__}: {exc}", flush=True)
                continue
            svc = GenerateService(f"ab-{v}", "1", path, engine, _NoText(), None, gen, request_timeout_s=600)
            svc.mark_ready()
            services[v] = (svc, lt)
            print(f"variant {v}: {kw} lt={lt}, loaded in {time.perf_counter() - t:.1f} s", flush=True)
        blas(False)

        async def run():
            for v, (svc, lt) in services.items():
                blas(lt)
                await _surge_round(svc, prompts[: min(n, 8)], 4)
                await _surge_round(svc, prompts, args.output)  # warm: the prefill shapes compile here
            if args.settle:
                from surge.runtime.gc_settle import settle

                settle()
            res = {v: [] for v in services}
            names = list(services)
            for load in ((0, args.busy_threads) if args.busy_threads else (0,)):
                busy = busy_threads(load)
                for r in range(args.rounds):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for v in order:
                        svc, lt = services[v]
                        blas(lt)
                        s0 = svc.steps
                        out = await _surge_round(svc, prompts, args.output)
                        out["steps"] = svc.steps - s0
                        res.setdefault(f"{v} (busy host: {load} threads)" if load else v, []).append(out)
                busy.set()
            profs = {}
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                for v, (svc, lt) in services.items():
                    blas(lt)
                    torch.cuda.synchronize()
                    s0 = svc.steps
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        out = await _surge_round(svc, prompts, args.output)
                        torch.cuda.synchronize()
                    steps = svc.steps - s0
                    by = {}
                    count = {}
                    for e in prof.events():
                        if e.device_type != torch.autograd.DeviceType.CUDA:
                            continue
                        k = kind(e.name)
                        by[k] = by.get(k, 0.0) + e.device_time
                        count[k] = count.get(k, 0) + 1
                    total = sum(by.values())
                    profs[v] = {"steps": steps, "wall_ms": 1e3 * out["wall_s"], "kernel_ms": total / 1e3,
                                "kernel_per_step_us": total / steps,
                                "by_kind_us_per_step": {k: round(x / steps, 2) for k, x in
                                                        sorted(by.items(), key=lambda kv: -kv[1])},
                                "launches_per_step": {k: round(c / steps, 1) for k, c in count.items()}}
            replay, restored = {}, {}
            for v, (svc, lt) in services.items():  # the bucket-64 graph alone: GPU time of one decode step
                blas(lt)
                restored[v] = graph_replay_us(svc.engine, restore=True)
                replay[v] = graph_replay_us(svc.engine)  # (restored too where the graph moves its inputs on)
            for svc, _ in services.values():
                await svc.close()
            return res, profs, replay, restored

        res, profs, replay, restored = asyncio.run(run())
    blas(False)
    print(f"\n{args.shape}, {n} streams, {args.prompt} + {args.output} tokens, {args.rounds} interleaved rounds")
    print("| variant | tok/s median | rounds tok/s | ITL p50 ms (median) | a token after the first, p50 ms | "
          "TTFT p50 ms | round wall ms | graph replay us (inputs restored each replay) |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    records = []
    for v, rs in res.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        rec = {"variant": v, "tok_s_median": med("tok_s"), "rounds_tok_s": [round(r["tok_s"]) for r in rs],
               "itl_p50_ms": med("itl_p50_ms"), "itl_p99_ms": med("itl_p99_ms"), "ttft_p50_ms": med("ttft_p50_ms"),
               "tpot_p50_ms": med("tpot_p50_ms"),
               "wall_ms": 1e3 * med("wall_s"), "steps": [r["steps"] for r in rs], "profile": profs.get(v),
               "graph_replay_us": replay[v.split(" (busy")[0]],
               "graph_replay_restored_us": restored[v.split(" (busy")[0]]}
        records.append(rec)
        print(f"| {v} | {rec['tok_s_median']:,.0f} | {' / '.join(f'{x:,}' for x in rec['rounds_tok_s'])} | "
              f"{rec['itl_p50_ms']:.3f} | {rec['tpot_p50_ms']:.3f} | {rec['ttft_p50_ms']:.1f} | {rec['wall_ms']:.1f} | "
              f"{rec['graph_replay_us']:.1f} ({rec['graph_replay_restored_us']:.1f}) |")
    if profs:
        print("\nprofiled round: kernel us per step by kind")
        for v, p in profs.items():
            print(f"{v}: {p['kernel_per_step_us']:.1f} us/step, wall {p['wall_ms']:.1f} ms / {p['steps']} steps; "
                  + json.dumps(p["by_kind_us_per_step"]))
            print("   launches/step " + json.dumps(p["launches_per_step"]))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One prefill step of many prompts: the device's time against the wall's, and the host's hot spots (issue 18).

    python3 benchmarks/generate_prefill_host.py --device cuda --shape qwen2-0.5b --prompts 32 --prompts 64
    python3 benchmarks/generate_prefill_host.py --device cuda --prompts 64 --quantization none --quantization fp8 \
        --quantization fp8-weight-only --kernels 12

benchmarks/generate_timeline.py found a round's prefill steps taking 13-28 ms of wall for ~7 ms of kernels
(session 16). Here the engine's `step` runs alone on N prompts (blocks allocated by the real scheduler):
wall per step (median of 7), the kernels' sum under torch.profiler, and cProfile's top functions of one step.
With several --quantization forms (engines built one after another on the same weights) and --kernels N, the N
kernels that take the most device time in one step, per form: where an 8-bit form's prefill loses to BF16's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, build  # noqa: E402


def scheduled_prompts(engine, prompts):
    """The prompts admitted by the real scheduler (blocks allocated): the step's scheduled list."""
    from surge.runtime.scheduler import SamplingParams
    from surge.runtime.scheduler.scheduler import Scheduler, SchedulerConfig
    from surge.runtime.scheduler.sequence import Sequence

    n_tok = sum(len(p) for p in prompts)
    sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size,
                                      max_num_seqs=len(prompts), max_num_batched_tokens=n_tok,
                                      max_model_len=engine.max_model_len, prefix_caching=False))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add(Sequence(i, list(p), params, time.monotonic()))
    out = sched.schedule()
    assert len(out) == len(prompts) and sum(s.num_tokens for s in out) == n_tok
    return out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_table(prof) -> list[tuple[str, int, float]]:
    """(kernel name, launches, device ms) of every kernel of a profiled step, most time first."""
    by = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n, t = by.get(e.name, (0, 0.0))
            by[e.name] = (n + 1, t + (getattr(e, "device_time", 0) or e.cuda_time) / 1e3)
    return sorted(((k, n, t) for k, (n, t) in by.items()), key=lambda r: -r[2])


def enqueue_ms(engine, scheduled) -> float:
    """The host's time to issue one step (engine.step with its sampler, where the step waits for the device, left
    out), median of 5, the device idle before each: the step's wall if the device took no time."""
    sampler, times = engine.sampler, []
    engine.sampler = lambda logits, seqs: []
    try:
        for _ in range(5):
            sync()
            t = time.perf_counter()
            engine.step(scheduled)
            times.append(1e3 * (time.perf_counter() - t))
            sync()
    finally:
        engine.sampler = sampler
    return statistics.median(times)


def measure(engine, prompts, quant: str, args, cuda: bool) -> dict:
    """One prefill step of the prompts on this engine: wall (median of 7), kernels, cProfile, top kernels."""
    n = len(prompts)
    scheduled = scheduled_prompts(engine, prompts)
    for _ in range(2):
        engine.step(scheduled)
    sync()
    walls = []
    for _ in range(7):
        t = time.perf_counter()
        engine.step(scheduled)
        sync()
        walls.append(1e3 * (time.perf_counter() - t))
    rec = {"quantization": quant, "engine_quantization": engine.model.quantization, "prompts": n,
           "tokens": n * args.prompt, "wall_ms": statistics.median(walls), "walls_ms": [round(w, 2) for w in walls]}
    if cuda:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step(scheduled)
            sync()
        kernels = kernel_table(prof)
        rec["kernel_ms"] = sum(t for _, _, t in kernels)
        rec["kernels"] = sum(c for _, c, _ in kernels)
        if args.kernels:
            rec["top_kernels"] = [[k[:120], c, round(t, 4)] for k, c, t in kernels[:args.kernels]]
    if args.host_ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step(scheduled)
            sync()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.host_ops)
        rec["host_ops"] = table
        rec["enqueue_ms"] = enqueue_ms(engine, scheduled)
        print(f"[{quant}] enqueue {rec['enqueue_ms']:.2f} ms (median of 5: the step's launches issued, no sync)")
        print(table)
    pr = cProfile.Profile()
    pr.enable()
    engine.step(scheduled)
    sync()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(f"\n[{quant}: {rec['engine_quantization']}] {n} prompts x {args.prompt} tokens: wall {rec['wall_ms']:.2f} ms "
          f"(median of 7: {rec['walls_ms']}), kernels {rec.get('kernel_ms', float('nan')):.2f} ms in "
          f"{rec.get('kernels', 0)} launches")
    for k, c, t in rec.get("top_kernels", []):
        print(f"  {t:9.3f} ms {c:5d} x  {k}")
    print("cProfile of one step (its own overhead included):")
    print("\n".join(s.getvalue().splitlines()[:40]))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--prompts", type=int, action="append")
    ap.add_argument("--quantization", action="append", choices=["none", "fp8", "fp8-weight-only", "int8"],
                    help="weight forms to measure, one engine each (default: none, BF16)")
    ap.add_argument("--kernels", type=int, default=0, help="print the N kernels with the most device time a step")
    ap.add_argument("--host-ops", type=int, default=0,
                    help="print the N ops with the most host time a step (torch.profiler's self CPU time) and the "
                         "step's enqueue time (its launches issued, before the read-back waits for the device)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from surge.engines.decoder import DecoderEngine

    cuda = args.device.startswith("cuda")
    shape = args.shape or ("qwen2-0.5b" if cuda else "gpt2-tiny")
    counts = args.prompts or [32, 64]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build(shape, Path(tmp) / shape, args.device)
        vocab = SHAPES[shape][1].get("vocab_size", 1000)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(2, vocab, (max(counts), args.prompt), generator=g).tolist()
        for quant in args.quantization or ["none"]:
            engine = DecoderEngine(path, device=args.device, max_num_seqs=max(counts),
                                   max_model_len=args.prompt + 144,
                                   kv_cache_tokens=(max(counts) + 8) * (args.prompt + 144),
                                   quantization=quant.removesuffix("-weight-only"),
                                   fp8_activations=not quant.endswith("-weight-only"))
            engine.warmup()
            for n in counts:
                records.append(measure(engine, prompts[:n], quant, args, cuda))
            del engine
            if cuda:
                torch.cuda.empty_cache()
    print(json.dumps(records))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One prefill step of many prompts: the device's time against the wall's, and the host's hot spots (issue 18).

    python3 benchmarks/generate_prefill_host.py --device cuda --shape qwen2-0.5b --prompts 32 --prompts 64

benchmarks/generate_timeline.py found a round's prefill steps taking 13-28 ms of wall for ~7 ms of kernels
(session 16). Here the engine's `step` runs alone on N prompts (blocks allocated by the real scheduler):
wall per step (median of 7), the kernels' sum under torch.profiler, and cProfile's top functions of one step.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--prompts", type=int, action="append")
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
        engine = DecoderEngine(path, device=args.device, max_num_seqs=max(counts),
                               max_model_len=args.prompt + 144, kv_cache_tokens=(max(counts) + 8) * (args.prompt + 144))
        engine.warmup()
        for n in counts:
            scheduled = scheduled_prompts(engine, prompts[:n])
            for _ in range(2):
                engine.step(scheduled)
            sync()
            walls = []
            for _ in range(7):
                t = time.perf_counter()
                engine.step(scheduled)
                sync()
                walls.append(1e3 * (time.perf_counter() - t))
            rec = {"prompts": n, "tokens": n * args.prompt, "wall_ms": statistics.median(walls),
                   "walls_ms": [round(w, 2) for w in walls]}
            if cuda:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    engine.step(scheduled)
                    sync()
                evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                rec["kernel_ms"] = sum(getattr(e, "device_time", 0) or e.cuda_time for e in evs) / 1e3
                rec["kernels"] = len(evs)
            pr = cProfile.Profile()
            pr.enable()
            engine.step(scheduled)
            sync()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
            print(f"\n{n} prompts x {args.prompt} tokens: wall {rec['wall_ms']:.2f} ms (median of 7: "
                  f"{rec['walls_ms']}), kernels {rec.get('kernel_ms', float('nan')):.2f} ms in "
                  f"{rec.get('kernels', 0)} launches\ncProfile of one step (its own overhead included):")
            print("\n".join(s.getvalue().splitlines()[:40]))
            records.append(rec)
    print(json.dumps(records))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

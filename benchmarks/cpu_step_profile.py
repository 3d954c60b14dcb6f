"""Where the CPU engine's steps spend their time: torch.profiler over consecutive engine steps, started and
stopped inside the engine's own thread (a profiler started on the main thread sees none of its ops).
generate.py's workload (GPT-2 small, 8 streams, 64 + 32 tokens, 2 threads); three rounds, the profiler over
--steps steps from --first on (one of them may be a prefill); prints each step's time and the ops' table.

    PYTHONPATH=src python3 benchmarks/cpu_step_profile.py [--dtype bf16] [--quantization w8a8] [--first 45] [--steps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

import generate  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    generate.add_engine_args(ap)
    ap.add_argument("--first", type=int, default=45, help="the first profiled step (the third round's)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--quantization", choices=["none", "w8a8"], default="none",
                    help="w8a8: the CPU's INT8 products (--generation quantization=w8a8)")
    args = ap.parse_args(["--device", "cpu", "--streams", "8", "--prompt", "64", "--output", "32", "--threads", "2",
                          *sys.argv[1:]])
    args.dtype = args.dtype or "fp32"
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = generate.build("gpt2-small", Path(tmp) / "m", "cpu")
        prompts = torch.randint(2, 50257, (args.streams, args.prompt), generator=torch.Generator().manual_seed(1))
        engine, service, _ = generate.make_service(path, args, args.streams, quantization=args.quantization)
        state = {"n": 0, "prof": None, "times": []}
        step = engine.step

        def profiled_step(scheduled):
            state["n"] += 1
            if state["n"] == args.first:
                state["prof"] = profile(activities=[ProfilerActivity.CPU])
                state["prof"].__enter__()
            t = time.perf_counter()
            out = step(scheduled)
            state["times"].append(time.perf_counter() - t)
            if state["n"] == args.first + args.steps - 1:
                state["prof"].__exit__(None, None, None)
            return out

        engine.step = profiled_step

        async def rounds():
            for _ in range(3):
                r = await generate._surge_round(service, prompts.tolist(), args.output)
                print(f"round: {r['tok_s']:.1f} tok/s, ITL p50 {r['itl_p50_ms']:.1f} ms")
            await service.close()

        asyncio.run(rounds())
    print("step ms:", [round(1e3 * t, 1) for t in state["times"][args.first - 1:args.first - 1 + args.steps]])
    print(state["prof"].key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=50))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a generation round's wall time goes, step by step (issue 18).

    python3 benchmarks/generate_timeline.py --device cuda --shape qwen2-0.5b --budget 8192
    python3 benchmarks/generate_timeline.py --device cpu --shape gpt2-tiny --streams 8 --prompt 32 --output 16

benchmarks/generate.py reports a round's output tokens/s; a round is `--streams` prompts submitted at once,
each generating `--output` tokens. With a 0.80 ms decode step, 127 steps are ~102 ms of a ~145 ms round
(session 11): this tells where the other ~40 ms are. The engine's calls are wrapped (timing only: no
synchronization is added) and each round prints:

* when the scheduler first ran after the round's submissions, and how many prompts each early step admitted;
* every step that prefilled (prompt tokens, decode rows, its wall time: a prefill step is synchronous);
* the decode steps' launch-to-launch interval (median, p99) and the round's tail (last step to last token);
* per stream: time to first token, and the sum that makes up the round.

Then prefill-only rounds (one output token: the round is the prefill) are timed alone and, on the GPU, one of
them under torch.profiler, whose kernel table shows what the prefill of all prompts costs.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, add_engine_args, build, graph_replay_us, make_service, pct  # noqa: E402


class Timeline:
    """Wall-clock records of the scheduler's and the engine's calls during one round."""

    def __init__(self, service):
        self.events: list[tuple] = []  # (kind, t0, t1, info)
        sched, engine = service.scheduler, service.engine
        self._restore = []
        self._wrap(sched, "schedule", lambda out: self._sched_info(out))
        for name in ("step", "launch", "collect_tokens", "collect"):
            if hasattr(engine, name):
                self._wrap(engine, name, None)

    @staticmethod
    def _sched_info(out):
        prefill = sum(s.num_tokens for s in out if s.num_tokens > 1 or s.start < s.seq.num_prompt)
        return {"rows": len(out), "prefill_tokens": prefill,
                "new": sum(1 for s in out if s.start == 0)}

    def _wrap(self, obj, name, info):
        fn = getattr(obj, name)
        events = self.events

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            events.append((name, t0, time.perf_counter(), info(out) if info else None))
            return out

        setattr(obj, name, wrapped)
        self._restore.append((obj, name))

    def close(self):
        for obj, name in self._restore:
            delattr(obj, name)  # the instance attribute goes; the class's method is seen again


async def timed_round(service, prompts, n_out):
    from surge.runtime.scheduler import SamplingParams

    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    first, last = [], []

    async def one(p):
        start, seen = time.perf_counter(), False
        async for _ in service.stream(p, params, deadline=time.monotonic() + 600):
            now = time.perf_counter()
            if not seen:
                first.append((start, now))
                seen = True
        last.append(time.perf_counter())

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return {"t0": t0, "t_end": time.perf_counter(), "first": first, "last": last}


def report(r, events, n_out) -> dict:
    t0 = r["t0"]
    ms = lambda t: 1e3 * (t - t0)  # noqa: E731
    scheds = [e for e in events if e[0] == "schedule"]
    steps = [e for e in events if e[0] == "step"]
    launches = [e for e in events if e[0] == "launch"]
    ttft = sorted(1e3 * (b - a) for a, b in r["first"])
    submitted = max(a for a, _ in r["first"])
    print(f"  last submission at {ms(submitted):.2f} ms; first schedule at {ms(scheds[0][1]):.2f} ms; "
          f"TTFT p0/p50/p100 {ttft[0]:.1f} / {pct(ttft, 50):.1f} / {ttft[-1]:.1f} ms")
    pre = [e for e in scheds if e[3]["prefill_tokens"]]
    for e in pre[:8]:
        print(f"  schedule at {ms(e[1]):7.2f} ms: {e[3]['new']} new prompts, {e[3]['prefill_tokens']} prompt tokens, "
              f"{e[3]['rows']} rows")
    for e in steps[:8]:
        print(f"  synchronous step {ms(e[1]):7.2f} -> {ms(e[2]):7.2f} ms ({1e3 * (e[2] - e[1]):.2f} ms)")
    gaps = [1e3 * (b[1] - a[1]) for a, b in zip(launches, launches[1:])]
    first_launch = ms(launches[0][1]) if launches else float("nan")
    end_steps = max(e[2] for e in events)
    out = {"wall_ms": ms(r["t_end"]), "tok_s": len(r["last"]) * n_out / (r["t_end"] - t0),
           "last_submission_ms": ms(submitted), "first_schedule_ms": ms(scheds[0][1]),
           "prefill_schedules": len(pre), "sync_steps_ms": [round(1e3 * (e[2] - e[1]), 2) for e in steps],
           "first_launch_ms": first_launch, "launches": len(launches),
           "launch_gap_p50_ms": pct(gaps, 50), "launch_gap_p99_ms": pct(gaps, 99),
           "last_engine_call_ms": ms(end_steps), "tail_ms": 1e3 * (max(r["last"]) - end_steps),
           "ttft_p50_ms": pct(ttft, 50), "ttft_max_ms": ttft[-1]}
    print(f"  decode launches {len(launches)} from {first_launch:.2f} ms, launch-to-launch p50 "
          f"{out['launch_gap_p50_ms']:.3f} / p99 {out['launch_gap_p99_ms']:.3f} ms; last engine call ends "
          f"{ms(end_steps):.2f} ms, last token {ms(max(r['last'])):.2f} ms; round {out['wall_ms']:.2f} ms "
          f"({out['tok_s']:.0f} tok/s)")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, budget=8192)
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    shape = args.shape or ("qwen2-0.5b" if cuda else "gpt2-tiny")
    record = {"shape": shape, "device": args.device, "streams": args.streams, "prompt": args.prompt,
              "output": args.output, "budget": args.budget, "rounds": [], "prefill_only_ms": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = build(shape, Path(tmp) / shape, args.device)
        vocab = SHAPES[shape][1].get("vocab_size", 1000)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(2, vocab, (args.streams, args.prompt), generator=g).tolist()
        engine, service, _ = make_service(path, args, len(prompts))

        async def run():
            from generate import _surge_round

            await _surge_round(service, prompts[:8], 4)  # Triton compiles the prefill variants
            await _surge_round(service, prompts, 2)
            for i in range(args.rounds):
                tl = Timeline(service)
                r = await timed_round(service, prompts, args.output)
                tl.close()
                print(f"round {i + 1}:")
                record["rounds"].append(report(r, tl.events, args.output))
            for _ in range(5):  # prefill-only rounds: one output token each
                r = await timed_round(service, prompts, 1)
                record["prefill_only_ms"].append(round(1e3 * (r["t_end"] - r["t0"]), 2))
            print(f"prefill-only rounds (all {len(prompts)} prompts, one token each): {record['prefill_only_ms']} ms")
            if cuda:
                from torch.profiler import ProfilerActivity, profile

                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    await timed_round(service, prompts, 1)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=80))
                evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                record["prefill_kernel_ms"] = sum(getattr(e, "device_time", 0) or e.cuda_time for e in evs) / 1e3
                print(f"prefill-only round under the profiler: kernel time {record['prefill_kernel_ms']:.2f} ms")
                record["graph_replay_us"] = graph_replay_us(engine)
            await service.close()

        asyncio.run(run())
    rounds = record["rounds"]
    for key in ("wall_ms", "tok_s", "ttft_p50_ms", "first_launch_ms", "launch_gap_p50_ms", "tail_ms"):
        record[key + "_median"] = statistics.median(r[key] for r in rounds)
    print(json.dumps({k: v for k, v in record.items() if k != "rounds"}))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 18: the floor of a persistent decode-step kernel on this GPU (engines/kernels/stream_floor.py).

The 8x target asks for the Qwen2-0.5B decode step at 64 streams in ~0.40 ms with the host (docs/benchmarks/
generate.md, session 42: 8x that run's compiled baseline is a 68 ms round; less the 17 ms prefill, 127 steps in
51 ms). The engine's step is ~0.9 ms on an H100. This measures, in one call:

* what this GPU reads at all: torch reading the step's bytes (a sum over them) and the probe streaming them as one
  phase with no barriers: the memory floor of the step as a kernel sees it;
* the step's bytes in its 121 dependent phases (24 layers x qkv, attention K/V, o, gate/up, down; the LM head),
  streamed by a producer warp that never waits for activations, with and without grid barriers between phases, and
  with each box also multiplied by its 64-row activation chunk read by TMA from what the previous phase wrote (the
  activation traffic and arithmetic of a 64-stream batch): what a megakernel of this design could take at best,
  before attention's own dependent reads, norms, RoPE, sampling and the host;
* each against the engine's step time (the `--step-us` of the same card, measured by benchmarks/generate.py) and
  the target's ~400 us.

    PYTHONPATH=src python3 benchmarks/gpu_megakernel_floor.py --json OUT.json [--context 192] [--repeats 15]
    python3 benchmarks/gpu_megakernel_floor.py --plot OUT.png REC.json --step-us 908.6 --budget-us "392:why,480:why"  # no GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

QWEN2_05B = dict(layers=24, hidden=896, inter=4864, heads=14, kv_heads=2, head_dim=64, vocab=151936)


def timed(fn, reset, repeats: int, warmup: int = 3) -> float:
    """Median us of `repeats` single launches, each after `reset` (outside the timed interval)."""
    for _ in range(warmup):
        reset()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        reset()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def plot(rec: dict, out: Path, step_us: float | None, budgets: list[tuple[float, str]]) -> None:
    """Bars: each kind of variant's best time over the plans of one record; lines: the engine's step and the
    target's budgets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [("torch: sum over the step's bytes", "read the step's bytes once (torch)"),
             ("one phase, no barrier", "producer-warp stream, one phase"),
             ("phases, no barrier", "121 phases, no barrier"),
             ("grid barriers, no stream", "121 grid barriers alone"),
             ("phases, grid barriers", "121 phases + grid barriers"),
             ("phases, grid barriers, MMA + activations", "+ 64-row MMA and activations")]
    bars = []
    for key, label in kinds:
        us = [r["us"] for r in rec["rows"] if r["variant"].endswith(key)]
        if us:
            bars.append((label, min(us)))
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh([b[0] for b in bars][::-1], [b[1] for b in bars][::-1], color="#4c72b0")
    for y, (_, us) in enumerate(bars[::-1]):
        ax.text(us + 8, y, f"{us:.0f}", va="center", fontsize=8)
    if step_us:
        ax.axvline(step_us, color="#c44e52", label=f"the engine's decode step ({step_us:.0f} us)")
    for (b, why), style in zip(budgets, ("--", ":", "-."), strict=False):
        ax.axvline(b, color="#55a868", linestyle=style, label=f"8x needs a step <= {b:.0f} us{why}")
    ax.set_xlabel(f"us a decode step ({rec['device']}, {rec['step_bytes'] / 1e9:.2f} GB a step)")
    ax.set_title("Qwen2-0.5B decode step, 64 streams: a persistent kernel's floor")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="with a saved record: a bar chart (PNG), no GPU")
    ap.add_argument("--budget-us", default="",
                    help="with --plot: the target's step budgets, comma separated, each US or US:why")
    ap.add_argument("record", nargs="?", type=Path)
    ap.add_argument("--context", type=int, default=192, help="positions of K/V a stream (the round's mean: 128-256)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--plans", default="128x12,64x24,128x8",
                    help="box rows x ring stages [x activation stages, default 2], comma separated")
    ap.add_argument("--step-us", type=float, default=None, help="the engine's decode step on this card, for the table")
    ap.add_argument("--target-us", type=float, default=400.0)
    args = ap.parse_args()
    if args.record:
        if not args.plot:
            ap.error("a record is given to plot: add --plot PNG")
        budgets = [(float(b.partition(":")[0]), f" ({b.partition(':')[2]})" if ":" in b else "")
                   for b in args.budget_us.split(",") if b]
        plot(json.loads(args.record.read_text()), args.plot, args.step_us, budgets)
        return

    from surge.engines.kernels.stream_floor import StreamFloor, step_phases

    dev = torch.cuda.get_device_properties(0)
    report = {"device": dev.name, "sms": dev.multi_processor_count, "context": args.context, "batch": args.batch,
              "target_us": args.target_us, "engine_step_us": args.step_us, "rows": []}
    print(f"{dev.name}, {dev.multi_processor_count} SMs; Qwen2-0.5B decode step, {args.batch} streams x "
          f"{args.context} positions", flush=True)

    def row(name, us, nbytes, **kw):
        r = {"variant": name, "us": round(us, 1), "TB/s": round(nbytes / us / 1e6, 3), "per_phase_us":
             round(us / report.get("phases", 1), 2), **kw}
        report["rows"].append(r)
        print(f"{name:58s} {us:9.1f} us  {r['TB/s']:6.3f} TB/s", flush=True)

    for plan in args.plans.split(","):
        box, stages, astages = ([int(x) for x in plan.split("x")] + [2])[:3]
        phases = step_phases(batch=args.batch, context=args.context, box_bytes=box * 128, **QWEN2_05B)
        probe = StreamFloor(phases, box_rows=box, stages=stages, astages=astages)
        one = StreamFloor([("all", probe.total_boxes, 14)], box_rows=box, stages=stages, weights=probe.weights)
        nbytes = probe.nbytes
        if plan == args.plans.split(",")[0]:
            report["step_bytes"] = nbytes
            report["phases"] = len(phases)
            flat = probe.weights.view(-1)
            us = timed(lambda flat=flat: flat.sum(dtype=torch.float32), lambda: None, args.repeats)
            row("torch: sum over the step's bytes", us, nbytes)
            # the barriers alone: as many phases, one box in all (what a barrier costs with no stream beside it)
            bare = StreamFloor([("one", 1, 1)] + [("none", 0, 1)] * (len(phases) - 1), box_rows=box, stages=stages)
            bare.run(True, False)
            torch.cuda.synchronize()
            assert int(bare.counter.item()) == len(phases) * bare.programs
            us = timed(lambda bare=bare: bare.launch(True, False), bare.reset, args.repeats)
            row(f"{len(phases)} grid barriers, no stream", us, 0)
            del bare
        for name, p, sync, mma in (("one phase, no barrier", one, False, False),
                                   (f"{len(phases)} phases, no barrier", probe, False, False),
                                   (f"{len(phases)} phases, grid barriers", probe, True, False),
                                   (f"{len(phases)} phases, no barrier, MMA + activations", probe, False, True),
                                   (f"{len(phases)} phases, grid barriers, MMA + activations", probe, True, True)):
            p.run(sync, mma)
            torch.cuda.synchronize()
            ok = torch.equal(p.counts.cpu(), p.deal()) and (not sync or int(p.counter.item()) == len(p.phases)
                                                            * p.programs)
            us = timed(lambda p=p, sync=sync, mma=mma: p.launch(sync, mma), p.reset, args.repeats)
            row(f"box {box} x {stages} x {astages}: {name}", us, nbytes, box=box, stages=stages, astages=astages,
                sync=sync, mma=mma, consumed_as_dealt=ok)
        del probe, one
        torch.cuda.empty_cache()
    if args.step_us:
        print(f"engine decode step (given): {args.step_us:.1f} us; target ~{args.target_us:.0f} us with the host")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

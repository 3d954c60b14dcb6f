"""Why the CPU's engine loop runs in a process of its own: one decoder step on the main thread against the same
step on a second thread of the same process (the engine loop's place when `engine_process=false`).

    PYTHONPATH=src python3 benchmarks/cpu_engine_thread.py [--dtype bf16] [--threads 2] [--rounds 5]
    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=src python3 benchmarks/cpu_engine_thread.py   (libgomp never spinning)

generate.py's random-weight GPT-2 small, 8 prompts of 64 tokens: the prefill step (one engine.step of 512
tokens) and then a decode step, each timed on the main thread and on a thread started for it, rounds
interleaved; the main thread has run torch's parallel regions first (loading, warm-up), as a server's has.
Prints the medians and the ratio (thread / main). On a machine with as many OpenMP threads in each team as
cores, a second team on the thread makes libgomp throttle its spin-wait (more OpenMP threads than CPUs), and
each of the step's short parallel regions then wakes its workers from sleep.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from generate import build  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence

    path = build("gpt2-small", Path(tempfile.mkdtemp()) / "model", "cpu")
    engine = DecoderEngine(path, device="cpu", dtype=args.dtype, max_num_seqs=8, max_model_len=256, num_blocks=400,
                           threads=args.threads)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 50000, (64,), generator=g).tolist() for _ in range(8)]

    def steps() -> tuple[float, float]:
        """(prefill, first decode step) seconds of 8 fresh sequences."""
        sched = Scheduler(SchedulerConfig(num_blocks=engine.num_blocks, block_size=engine.block_size, max_num_seqs=8,
                                          max_num_batched_tokens=1024, max_model_len=256, prefix_caching=False), ())
        for i, p in enumerate(prompts):
            sched.add(Sequence(i, p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))
        out = []
        for _ in range(2):
            scheduled = sched.schedule()
            t = time.perf_counter()
            got = engine.step(scheduled)
            out.append(time.perf_counter() - t)
            sched.update(scheduled, {k: o.token for k, o in got.items()})
        for s in list(sched.running):
            sched.abort(s)
        return out[0], out[1]

    def on_thread() -> tuple[float, float]:
        box = []
        th = threading.Thread(target=lambda: box.append(steps()))
        th.start()
        th.join()
        return box[0]

    steps()  # warm-up on both
    on_thread()
    main_t, thread_t = [], []
    for _ in range(args.rounds):
        main_t.append(steps())
        thread_t.append(on_thread())
    print(f"GPT-2 small, {args.dtype}, 8 x 64 tokens, {args.threads} threads, torch {torch.__version__}, medians of "
          f"{args.rounds} interleaved rounds\n")
    print("| step | main thread ms | second thread ms | second / main |\n| --- | ---: | ---: | ---: |")
    for j, name in enumerate(("prefill (512 tokens)", "decode (8 rows)")):
        m = statistics.median(r[j] for r in main_t) * 1e3
        t = statistics.median(r[j] for r in thread_t) * 1e3
        print(f"| {name} | {m:.1f} | {t:.1f} | {t / m:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Several GPUs: replicas (one engine per GPU, least-loaded dispatch) and a tensor-parallel XL encoder.

Part "replicas": BERT-base shape (random weights), batch 128 x 32, FP16.
  Closed-loop throughput (sequences/s) of a DevicePool over 1 GPU and over 2
  GPUs, `--clients` threads per GPU submitting the same batch shape; median of
  `--trials` timed windows. Target: 2 GPUs >= 1.9x 1 GPU.
Part "tp": XLM-R XL shape (hidden 2560, 36 layers, 32 heads, FFN 10240, vocab
  250880; ~3.5B parameters, random weights generated shard by shard on each
  GPU), batch 1 x 128, FP16. Latency of engine.run end to end (host included)
  on 1 GPU (world 1) and on 2 (world 2), the gain, and where the device time
  goes: the whole forward, the same compute with the all-reduces left out, and
  the 72 all-reduces alone (CUDA graphs timed with events; tp_profile).
  The 2-rank output is checked against the 1-rank output (cosine).

    PYTHONPATH=src python3 benchmarks/multi_gpu.py --out multi_gpu.json --plot multi_gpu.png
    PYTHONPATH=src python3 benchmarks/multi_gpu.py --dry-run   # tiny shapes on the CPU (gloo), proves it runs

NCCL runs with NVLink multicast off (tensor_parallel.NCCL_ENV) in every process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from surge.engines.tensor_parallel import NCCL_ENV

os.environ.update(NCCL_ENV)  # before torch initialises anything NCCL

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

from surge.engines.tensor_parallel import TensorParallelEngine  # noqa: E402
from surge.engines.torch_gpu import TorchEngine  # noqa: E402
from surge.engines.tp_weights import parameter_count, small_config, xlmr_xl_config  # noqa: E402
from surge.runtime.devices import DevicePool  # noqa: E402
from surge.types import Encoded, TokenBatch  # noqa: E402

console = Console(width=140)


def make_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> TokenBatch:
    rng = np.random.default_rng(seed)
    items = [Encoded(rng.integers(5, vocab, size=seq), np.zeros(seq, dtype=np.int64)) for _ in range(batch)]
    return TokenBatch.pack(items)


# ---------------------------------------------------------------- replicas

def save_random_bert(tmp: Path, dry: bool) -> Path:
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                     vocab_size=2000) if dry else BertConfig()  # bert-base shape
    torch.manual_seed(0)
    BertModel(cfg).eval().save_pretrained(tmp)
    return tmp


def throughput(pool: DevicePool, batch: TokenBatch, clients: int, seconds: float) -> float:
    """Sequences per second with `clients` threads each running batches back to back for `seconds`."""
    done = [0] * clients
    stop = threading.Event()

    def client(i):
        while not stop.is_set():
            pool.run(batch)
            done[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    stop.wait(seconds)
    stop.set()
    for th in threads:
        th.join()
    return sum(done) * batch.size / (time.perf_counter() - t0)


def bench_replicas(args, progress) -> dict:
    dry = args.dry_run
    n_dev = 2
    devices = [f"cpu:{i}" for i in range(n_dev)] if dry else [f"cuda:{i}" for i in range(n_dev)]
    with tempfile.TemporaryDirectory() as tmp:
        path = save_random_bert(Path(tmp), dry)
        engines = {}
        task = progress.add_task("replicas: loading engines", total=n_dev * args.instances)
        for d in devices:
            for _ in range(args.instances):
                e = TorchEngine(device="cpu" if dry else d, precision="fp32" if dry else "fp16",
                                max_batch=args.batch)
                e.load(path)
                engines.setdefault(d, []).append(e)
                progress.advance(task)
        batch = make_batch(args.batch, args.seq, 2000 if dry else 30522)
        for es in engines.values():
            for e in es:
                e.run(batch)  # captures this bucket's CUDA graph
        res = {}
        task = progress.add_task("replicas: timing", total=2 * args.trials)
        for n in (1, 2):
            labels = [d for d in devices[:n] for _ in range(args.instances)]
            pool = DevicePool([e for d in devices[:n] for e in engines[d]], labels)
            trials = []
            for _ in range(args.trials):
                trials.append(throughput(pool, batch, args.clients * n, args.seconds))
                progress.advance(task)
            res[n] = {"seq_per_s": statistics.median(trials), "trials": trials, "stats": pool.stats()}
        for es in engines.values():
            for e in es:
                e.close()
    res["ratio"] = res[2]["seq_per_s"] / res[1]["seq_per_s"]
    return res


# ---------------------------------------------------------------- tensor parallel

def e2e_ms(engine, batch: TokenBatch, iters: int) -> float:
    from surge.bench.timing import wall_ms

    return float(np.median(wall_ms(lambda: engine.run(batch), iters, warmup=3)))


def bench_tp(args, progress) -> dict:
    dry = args.dry_run
    cfg = small_config(hidden=256, heads=8, layers=4, intermediate=1024, vocab=5000, max_positions=160) \
        if dry else xlmr_xl_config()
    if args.layers:
        cfg = replace(cfg, layers=args.layers)
    batch = make_batch(1, args.tp_seq, cfg.vocab, seed=1)
    res: dict = {"params": parameter_count(cfg), "layers": cfg.layers}
    outputs = {}
    task = progress.add_task("tensor parallel", total=2)
    for world in (1, 2):
        e = TensorParallelEngine(world=world, devices=None if dry else list(range(world)),
                                 precision="fp32" if dry else args.precision, max_batch=8, seed=7,
                                 threads=1 if dry else 0)
        t0 = time.perf_counter()
        e.load(cfg)
        load_s = time.perf_counter() - t0
        outputs[world] = e.run(batch)
        lat = e2e_ms(e, batch, args.iters)
        prof = e.profile(batch, args.iters)
        e.close()
        res[world] = {"load_s": load_s, "e2e_ms": lat, **prof}
        progress.advance(task)
    a, b = outputs[1].astype(np.float64), outputs[2].astype(np.float64)
    res["cosine_min"] = float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())
    res["gain_e2e"] = res[1]["e2e_ms"] / res[2]["e2e_ms"]
    res["gain_device"] = res[1]["total_ms"] / res[2]["total_ms"]
    return res


# ---------------------------------------------------------------- report

def report(results: dict, args) -> None:
    where = "CPU (gloo), tiny shapes — NOT GPU numbers" if args.dry_run else \
        f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    console.print(f"[bold]multi_gpu[/bold] on {where}")
    if "replicas" in results:
        r = results["replicas"]
        t = Table(title=f"replicas: batch {args.batch} x {args.seq}, {args.instances} instance(s)/device, "
                        f"{args.clients} client(s)/device")
        for c in ("devices", "seq/s (median)", "vs 1 device", "batches per device"):
            t.add_column(c)
        for n in (1, 2):
            t.add_row(str(n), f"{r[n]['seq_per_s']:.0f}", f"{r[n]['seq_per_s'] / r[1]['seq_per_s']:.2f}x",
                      " / ".join(str(s["served_batches"]) for s in r[n]["stats"]))
        console.print(t)
        console.print(f"2-device ratio {r['ratio']:.2f}x (target >= 1.9x)")
    if "tp" in results:
        r = results["tp"]
        t = Table(title=f"tensor parallel: batch 1 x {args.tp_seq}, {r['params'] / 1e6:,.0f}M parameters, "
                        f"{r['layers']} layers")
        for c in ("ranks", "e2e ms", "device total ms", "compute ms", "all-reduce ms", "other ms", "all-reduces",
                  "load s"):
            t.add_column(c)
        for w in (1, 2):
            p = r[w]
            t.add_row(str(w), f"{p['e2e_ms']:.2f}", f"{p['total_ms']:.2f}", f"{p['compute_ms']:.2f}",
                      f"{p['allreduce_ms']:.2f}", f"{p['other_ms']:.2f}", str(p["allreduces"]), f"{p['load_s']:.1f}")
        console.print(t)
        console.print(f"gain 1 -> 2 ranks: e2e {r['gain_e2e']:.2f}x, device {r['gain_device']:.2f}x; "
                      f"2-rank vs 1-rank output: min cosine {r['cosine_min']:.6f}")


def plot(results: dict, path: Path, dry: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    tag = " (CPU dry run)" if dry else ""
    if "replicas" in results:
        r = results["replicas"]
        axes[0].bar(["1 device", "2 devices"], [r[1]["seq_per_s"], r[2]["seq_per_s"]], color=["#888", "#2a7"])
        axes[0].set_ylabel("sequences / s")
        axes[0].set_title(f"replicas: {r['ratio']:.2f}x{tag}")
    if "tp" in results:
        r = results["tp"]
        names = ["1 rank", "2 ranks"]
        comp = [r[w]["compute_ms"] for w in (1, 2)]
        ar = [r[w]["allreduce_ms"] for w in (1, 2)]
        other = [max(r[w]["other_ms"], 0) for w in (1, 2)]
        axes[1].bar(names, comp, label="compute")
        axes[1].bar(names, ar, bottom=comp, label="all-reduce")
        axes[1].bar(names, other, bottom=[c + a for c, a in zip(comp, ar)], label="other")
        axes[1].set_ylabel("ms (device)")
        axes[1].set_title(f"tensor parallel, batch 1: {r['gain_device']:.2f}x{tag}")
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (gloo): proves the script runs")
    ap.add_argument("--part", choices=["all", "replicas", "tp"], default="all")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--instances", type=int, default=2, help="engine instances (streams) per device")
    ap.add_argument("--clients", type=int, default=3, help="closed-loop client threads per device")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of one throughput window")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--tp-seq", type=int, default=128)
    ap.add_argument("--precision", default="fp16", choices=["fp16", "bf16"])
    ap.add_argument("--layers", type=int, default=0, help="override the XL layer count (0: 36)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    if args.dry_run:
        args.batch, args.seq, args.seconds, args.trials, args.iters = min(args.batch, 8), min(args.seq, 32), \
            min(args.seconds, 1.0), min(args.trials, 2), min(args.iters, 5)
        args.instances, args.clients = 1, 1
    elif torch.cuda.device_count() < 2:
        raise SystemExit(f"needs 2 CUDA GPUs, found {torch.cuda.device_count()} (use --dry-run on the CPU)")
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "dry_run": args.dry_run,
                     "args": {k: str(v) for k, v in vars(args).items()}}
    with Progress(console=console, transient=True) as progress:
        if args.part in ("all", "replicas"):
            results["replicas"] = bench_replicas(args, progress)
        if args.part in ("all", "tp"):
            results["tp"] = bench_tp(args, progress)
    report(results, args)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))
    if args.plot:
        plot(results, args.plot, args.dry_run)


if __name__ == "__main__":
    main()

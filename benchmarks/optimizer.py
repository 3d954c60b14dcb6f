"""Benchmark: PyTorch eager FP32 vs ONNX Runtime on the raw export vs surge FP32-optimized vs surge INT8.

Models: the bundled all-MiniLM-L6-v2 and a BERT-base with random weights
(bert-base-uncased's architecture from transformers' BertConfig defaults).
Same inputs, medians; the ratios are against PyTorch eager in the same run.
Each engine's timing block runs in a fresh process of its own (engines take
turns over several rounds), because PyTorch eager measured slower in a process
that also holds ONNX Runtime sessions than alone (12.7-15 vs 8-14 ms for MiniLM
at batch 1 x 32 on the 2-core VM); `--no-isolate` times everything in this process. Accuracy-gate results (and node counts) come from the same
`surge optimize` pipeline the CLI runs.

    PYTHONPATH=src python benchmarks/optimizer.py            # default: both models, 4 shapes, short
    PYTHONPATH=src python benchmarks/optimizer.py --quick    # MiniLM, batch 1 x seq 32 only
"""

from __future__ import annotations

import argparse
import os
import datetime
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from surge.bench.timing import cpu_name

import numpy as np

SHAPES = [(1, 32), (1, 128), (32, 32), (32, 128)]
EAGER = "pytorch eager fp32"


def make_bert_base(out: Path) -> Path:
    import torch
    from transformers import BertConfig, BertModel

    from surge.models import bundled_model_dir

    torch.manual_seed(0)
    BertModel(BertConfig()).eval().save_pretrained(out)  # BertConfig() is bert-base-uncased's shape
    shutil.copy(bundled_model_dir() / "tokenizer.json", out / "tokenizer.json")
    return out


def timed(fn, budget_s: float, max_runs: int) -> list[float]:
    """Times (ms) of fn() after one warm-up; stops after max_runs or budget_s, at least 3 runs."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return times


def inputs(vocab: int, batch: int, seq: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, min(vocab, 30522), size=(batch, seq), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def ort_runner(model_file: Path, threads: int):
    import json

    from surge.optimize.validate import session

    manifest = model_file.parent / "manifest.json"  # a surge artifact: load it as its engine does
    disabled = json.loads(manifest.read_text()).get("ort_disabled_optimizers", []) if manifest.exists() else []
    sess = session(model_file, threads, disabled)
    names = {i.name for i in sess.get_inputs()}
    return lambda feeds: sess.run(None, {k: v for k, v in feeds.items() if k in names})


def torch_runner(spec, threads: int):
    import torch

    from surge.optimize.export import load_torch_model

    if threads:
        torch.set_num_threads(threads)
    model = load_torch_model(spec)

    def run(feeds):
        with torch.inference_mode():
            return model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state

    return run


def bench_model(spec, cache: Path, work: Path, shapes, args, console) -> tuple[list[dict], dict]:
    from surge.data import calibration_sentences, heldout_sentences
    from surge.optimize.export import ensure_exported
    from surge.optimize.pipeline import GateFailed, OptimizeOptions, optimize

    raw = ensure_exported(spec, cache) / "model.onnx"
    n = args.sentences
    info = {}
    arts = {}
    for precision in ("fp32", "int8"):
        console.print(f"[bold]{spec.name}[/]: surge optimize --precision {precision}")
        opts = OptimizeOptions(precision=precision, measure_latency=False, threads=args.threads, force=True,
                               calibration=calibration_sentences()[:n], heldout=heldout_sentences()[:n])
        out = work / f"{spec.name}-{precision}"
        try:
            res = optimize(spec, out, opts, cache)
        except GateFailed as exc:  # force=True writes anyway; kept for clarity
            res = exc.result
        m = res.manifest
        arts[precision] = out / "model.onnx"
        sets = m["validation"]["sets"]
        info[precision] = {
            "nodes": m["nodes"], "fused_nodes": m["passes"][-1]["nodes_after"], "gate": m["validation"]["passed"],
            "failures": m["validation"]["failures"],
            "cosine": min(s["mean_cosine"] for s in sets.values()),
            "top1": min(s["top1"] for s in sets.values()), "top1_tie": min(s["top1_tie"] for s in sets.values()),
        }
    sources = {EAGER: ("torch", str(spec.path)), "onnxruntime raw export": ("ort", str(raw)),
               "surge fp32": ("ort", str(arts["fp32"])), "surge int8": ("ort", str(arts["int8"]))}
    if args.isolate:
        runners = {name: _isolated(kind, path, spec, args) for name, (kind, path) in sources.items()}
    else:
        runners = {name: (torch_runner(spec, args.threads) if kind == "torch" else ort_runner(Path(path), args.threads))
                   for name, (kind, path) in sources.items()}
    rows = []
    for batch, seq in shapes:
        feeds = inputs(spec.vocab_size, batch, seq)
        row = {"model": spec.name, "batch": batch, "seq": seq}
        samples: dict[str, list[float]] = {name: [] for name in runners}
        blocks: dict[str, list[float]] = {name: [] for name in runners}  # per-round block medians
        # Engines take turns in rounds (each a block of consecutive runs, so its caches
        # stay warm): a slow drift of the shared CPU hits every column alike instead
        # of whichever engine happened to be timed during it.
        for r in range(args.rounds):
            for name, run in runners.items():
                console.print(f"  {spec.name} b={batch} s={seq}: {name} (round {r + 1}/{args.rounds})")
                budget, runs = args.budget_s / args.rounds, max(3, args.max_runs // args.rounds)
                times = run(batch, seq, budget, runs) if args.isolate else timed(lambda: run(feeds), budget, runs)
                samples[name] += times
                blocks[name].append(statistics.median(times))
        base = blocks[EAGER]
        for name, times in samples.items():
            row[name] = statistics.median(times)
            # Paired ratios: each engine against the eager block of its own round,
            # seconds apart, so the VM's minute-to-minute speed cancels out.
            row[name + " ratios"] = [e / t for e, t in zip(base, blocks[name])]
        row["runs"] = min(len(t) for t in samples.values())
        rows.append(row)
    return rows, info


def _isolated(kind: str, path: str, spec, args):
    """A runner that times one block in a fresh Python process (see the module docstring)."""
    import json
    import subprocess

    def run(batch: int, seq: int, budget: float, runs: int) -> list[float]:
        job = {"kind": kind, "path": path, "name": spec.name, "vocab": spec.vocab_size, "batch": batch, "seq": seq,
               "threads": args.threads, "budget": budget, "runs": runs}
        out = subprocess.run([sys.executable, __file__, "--time-one", json.dumps(job)], capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run


def _time_one(job: str) -> None:
    import json

    j = json.loads(job)
    if j["kind"] == "torch":
        from surge.models import load_model_spec

        run = torch_runner(load_model_spec(Path(j["path"]), name=j["name"]), j["threads"])
    else:
        run = ort_runner(Path(j["path"]), j["threads"])
    feeds = inputs(j["vocab"], j["batch"], j["seq"])
    for _ in range(3):  # warm the process (allocator, thread pools) before timing
        run(feeds)
    print(json.dumps(timed(lambda: run(feeds), j["budget"], j["runs"])))


def markdown(rows, infos, args) -> str:
    engines = [EAGER, "onnxruntime raw export", "surge fp32", "surge int8"]
    lines = [f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC. Machine: {platform.machine()}, "
             f"{cpu_name()}, {_cores()} cores, load average at start {args.load_at_start}. Python {platform.python_version()}.",
             f"Command: `PYTHONPATH=src python benchmarks/optimizer.py {' '.join(sys.argv[1:])}`".rstrip(), "",
             f"Latency, median ms over up to {args.max_runs} runs per cell, engines taking turns in {args.rounds} rounds"
             + (", each block in a fresh process " if args.isolate else " in one process ") +
             "(speed-up vs PyTorch eager FP32 in the same run):", "",
             "| model | batch | seq | " + " | ".join(engines) + " |", "|---|---:|---:|" + "---:|" * len(engines)]
    for r in rows:
        base = r[EAGER]
        cells = [f"{r[e]:.1f} ({base / r[e]:.2f}x)" for e in engines]
        lines.append(f"| {r['model']} | {r['batch']} | {r['seq']} | " + " | ".join(cells) + " |")
    lines += ["", "Paired speed-ups: per round, eager's block median over the engine's block median "
              "(adjacent blocks, so a drifting VM hits both alike); median over the rounds [lowest, highest]:", "",
              "| model | batch | seq | " + " | ".join(engines[1:]) + " |", "|---|---:|---:|" + "---:|" * (len(engines) - 1)]
    for r in rows:
        cells = [f"{statistics.median(r[e + ' ratios']):.2f}x [{min(r[e + ' ratios']):.2f}, "
                 f"{max(r[e + ' ratios']):.2f}]" for e in engines[1:]]
        lines.append(f"| {r['model']} | {r['batch']} | {r['seq']} | " + " | ".join(cells) + " |")
    lines += ["", "Graph and accuracy (validation vs the FP32 source on the bundled sentences):", "",
              "| model | precision | nodes export → surge | reduction | mean cos (worst set) | top-1 strict | top-1 ties≤0.01 | gate (defaults) |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    for model, info in infos.items():
        for p, i in info.items():
            before, after = i["nodes"]["before"], i["fused_nodes"]
            gate = "pass" if i["gate"] else "FAIL: " + "; ".join(i["failures"])
            lines.append(f"| {model} | {p} | {before} → {i['nodes']['after']} | {before / after:.1f}x (graph passes: {after}) | "
                         f"{i['cosine']:.5f} | {i['top1']:.3f} | {i['top1_tie']:.3f} | {gate} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Speed-up over PyTorch eager per shape, one panel per model (PNG, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = ["onnxruntime raw export", "surge fp32", "surge int8"]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        x = np.arange(len(mine))
        for i, e in enumerate(engines):
            ax.bar(x + (i - 1) * 0.27, [r[EAGER] / r[e] for r in mine], 0.27, label=e)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, [f"b{r['batch']} s{r['seq']}" for r in mine])
        ax.set_ylabel("speed-up vs PyTorch eager FP32 (×)")
        ax.set_title(model)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)



def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def main() -> None:
    import os

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="MiniLM only, batch 1 x seq 32")
    parser.add_argument("--no-bert-base", action="store_true")
    parser.add_argument("--no-minilm", action="store_true", help="BERT-base only")
    parser.add_argument("--threads", type=int, default=0, help="threads for every engine (0: library default)")
    parser.add_argument("--budget-s", type=float, default=2.0, help="time per cell after 3 runs")
    parser.add_argument("--max-runs", type=int, default=150, help="timed runs per cell, at most (split over the rounds)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="engines take turns this many times per shape (default 3; 7 with --quick)")
    parser.add_argument("--sentences", type=int, default=100, help="calibration and held-out sentences for the gate")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--plot", type=Path, default=None, help="also write a PNG of the speed-ups here")
    parser.add_argument("--no-isolate", dest="isolate", action="store_false",
                        help="time every engine in this process instead of a fresh process per block")
    parser.add_argument("--time-one", default=None, help=argparse.SUPPRESS)  # internal: one isolated block
    i21 = parser.add_argument_group("issue 21 (benchmarks/optimizer_issue21.py)")
    i21.add_argument("--issue21", action="store_true", help="INT8 held-out accuracy + intervals, batch invariance, "
                     "retrieval, distilled student, serve FP32 vs INT8 end to end")
    i21.add_argument("--int8-artifact", default=None, help="reuse this INT8 artifact (default: optimize one)")
    i21.add_argument("--fp32-artifact", default=None, help="reuse this FP32 artifact (default: optimize one)")
    i21.add_argument("--student", default=None, help="a `surge distill` output directory to report")
    i21.add_argument("--clients", type=int, default=64, help="closed-loop clients for the serve comparison (0: skip)")
    i21.add_argument("--duration", type=float, default=20.0, help="measured seconds per server")
    i21.add_argument("--workdir", default=None)
    i21.add_argument("--serve-only", action="store_true", help="only the serve comparison (reuses --workdir's results)")
    i21.add_argument("--serve-runs", type=int, default=3, help="serve comparison repeats, FP32 and INT8 alternating (median reported)")
    i21.add_argument("--serve-args", default="", help="extra `surge serve` options for both servers, after --threads "
                     "(e.g. \"--threads 1 --instances 2\")")
    args = parser.parse_args()
    if args.time_one:
        return _time_one(args.time_one)
    if args.issue21:
        from rich.console import Console

        sys.path.insert(0, str(Path(__file__).parent))
        from optimizer_issue21 import main as issue21

        print(f"load average at start: {', '.join(f'{x:.1f}' for x in os.getloadavg())}", file=sys.stderr)
        issue21(args, Console(stderr=True))
        print(f"load average at end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}", file=sys.stderr)
        return
    args.rounds = args.rounds or (7 if args.quick else 3)
    args.load_at_start = ", ".join(f"{x:.1f}" for x in os.getloadavg())

    from rich.console import Console

    from surge.models import bundled_model_dir, load_model_spec

    console = Console(stderr=True)
    shapes = [(1, 32)] if args.quick else SHAPES
    rows, infos = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        specs = [] if args.no_minilm else [load_model_spec(bundled_model_dir())]
        if not (args.quick or args.no_bert_base):
            console.print("building BERT-base (random weights)")
            specs.append(load_model_spec(make_bert_base(tmp / "bert-base-random"), name="bert-base-random"))
        for spec in specs:
            r, info = bench_model(spec, tmp / "cache", tmp, shapes, args, console)
            rows += r
            infos[spec.name] = info
    text = markdown(rows, infos, args)
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

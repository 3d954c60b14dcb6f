"""What each kind of kernel costs inside the decode step's chain: the step's CUDA graph with that kind left out.

Sessions 10-21 left the Qwen2-0.5B decode step at ~0.80 ms against a ~0.29 ms memory floor, ~170 kernels
chained by programmatic dependent launch. Whether fusing two kinds (say the two `add_rmsnorm` a layer into the
GEMMs beside them) can pay is bounded by what the step loses when that kind is not there at all. This
script runs one real round of the issue's workload (so the KV caches and the graph's buffers hold ~190
positions a stream), then, for each ablation, captures the largest bucket's decode graph again with that
kind of kernel replaced by nothing (its consumers read a stale tensor of the right shape: the values are
wrong, the timing is the point) and times its replays (50 back to back, median of `--repeats`), with the
unchanged step captured the same way first and last (the drift between them is the noise floor).

    PYTHONPATH=src python3 benchmarks/gpu_step_ablation.py --shape qwen2-0.5b --json OUT.json
    python3 benchmarks/gpu_step_ablation.py --plot STEP.png A.json [B.json ...]   # bars from saved records, no GPU

Ablations (each alone): norms (both add_rmsnorm a layer and the first), attention (the one-kernel decode
attention), qkv / o / down (the layer GEMMs' split-K partials), gate_up (SiLU(gate) * up), lm_head (the
tied LM head GEMM; its argmax stays), norms+attention.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

ABLATIONS = ("norms", "attention", "qkv", "o", "down", "gate_up", "lm_head", "norms+attention")


@contextmanager
def ablated(model, kinds: set[str], cache: dict):
    """Patch the model's decode path so that the named kinds launch nothing (stale outputs from `cache`,
    filled on first use by running the real kernel once, outside any capture)."""
    from surge.engines.kernels import decode_attention as da
    from surge.engines.kernels import decoder_fused as df

    saved = (df.add_rmsnorm, da.decode_attention)
    patched = []

    def remember(key, fn, *a, **kw):
        if key not in cache:
            cache[key] = fn(*a, **kw)
        return cache[key]

    if "norms" in kinds:
        df.add_rmsnorm = lambda x, delta, weight, eps, pdl=False: x
    if "attention" in kinds:
        real = da.decode_attention
        da.decode_attention = lambda qkv, *a, **kw: remember(("attention", qkv.shape), real, qkv, *a, **kw)
    gemms = {k for k in kinds if k in ("qkv", "o", "down")}
    if gemms:
        real_proj = model._proj

        def proj(x, name, bias=None):
            kind = name.rsplit(".", 1)[-1]
            if kind in gemms:
                return remember((name, x.shape), real_proj, x, name, bias)
            return real_proj(x, name, bias)

        model._proj = proj
        patched.append("_proj")
    if "gate_up" in kinds:
        real_mlp = model._mlp_in
        model._mlp_in = lambda h, layer, masks=None: remember((layer, h.shape), real_mlp, h, layer, masks)
        patched.append("_mlp_in")
    if "lm_head" in kinds:
        real_logits = model.logits
        model.logits = lambda hidden, upcast=True: remember(("lm_head", hidden.shape, upcast), real_logits, hidden,
                                                            upcast)
        patched.append("logits")
    try:
        yield
    finally:
        df.add_rmsnorm, da.decode_attention = saved
        for name in patched:
            delattr(model, name)  # the instance attribute goes; the class's method shows again


def capture_and_time(graphs, bucket: int, repeats: int) -> float:
    """A fresh CUDA graph of graphs._forward(bucket) (warmed up twice), replayed 50 times back to back;
    the median over `repeats` of the mean replay, in us."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode(), torch.cuda.stream(stream):
        for _ in range(2):
            graphs._forward(bucket)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            graphs._forward(bucket)
    torch.cuda.current_stream().wait_stream(stream)
    from benchmarks.generate import replay_us

    return replay_us(g, repeats)


def plot(records: list[dict], out: Path) -> None:
    """One bar chart: us a step saved when each kind is left out, a bar group per record (shape)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [a for a in ABLATIONS if "+" not in a]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(records)
    for i, rec in enumerate(records):
        rows = {r["ablation"]: r["step_us"] for r in rec["rows"]}
        base = (rows["none (first)"] + rows["none (last)"]) / 2
        ax.bar([k + i * width for k in range(len(kinds))], [base - rows[k] for k in kinds], width,
               label=f"{rec['shape']} ({base:.0f} us a step)")
    ax.set_xticks([k + width * (len(records) - 1) / 2 for k in range(len(kinds))], kinds)
    ax.set_ylabel("us a decode step saved when left out")
    ax.set_title("The decode step's kernels by kind, inside the PDL chain (bucket 64, H200)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2-0.5b")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ablations", default=",".join(ABLATIONS))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="a bar chart (PNG) of the records given, or of this run's")
    ap.add_argument("records", nargs="*", type=Path, help="saved --json records to plot (no GPU run)")
    args = ap.parse_args(argv)
    if args.records:
        if not args.plot:
            ap.error("records are given to plot: add --plot PNG")
        plot([json.loads(f.read_text()) for f in args.records], args.plot)
        return 0
    from benchmarks.generate import _surge_round, build, make_service

    run_args = argparse.Namespace(prompt=args.prompt, output=args.output, budget=args.streams * args.prompt,
                                  overlap_depth=2, device="cuda", dtype="bf16", threads=0, no_graphs=False,
                                  decode_gemm="auto", decode_attention="fused", no_pdl=False,
                                  decode_steps=1)  # the step as one launch runs it: its inputs staged by the host
    with tempfile.TemporaryDirectory() as tmp:
        path = build(args.shape, Path(tmp) / "m", "cpu")
        engine, service, _ = make_service(path, run_args, args.streams)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(2, engine.cfg.vocab_size, (args.streams, args.prompt), generator=g).tolist()

        async def one_round():
            await _surge_round(service, prompts, args.output)
            await service.close()

        asyncio.run(one_round())
        graphs, bucket = engine.graphs, max(engine.graphs.graphs)
        cache: dict = {}
        rows = [("none (first)", capture_and_time(graphs, bucket, args.repeats))]
        for name in [a for a in args.ablations.split(",") if a]:
            with ablated(engine.model, set(name.split("+")), cache):
                with torch.inference_mode():
                    graphs._forward(bucket)  # fills the cache with the real outputs, outside a capture
                rows.append((name, capture_and_time(graphs, bucket, args.repeats)))
            print(f"{name}: {rows[-1][1]:.1f} us", flush=True)
        rows.append(("none (last)", capture_and_time(graphs, bucket, args.repeats)))
    base = statistics.mean([rows[0][1], rows[-1][1]])
    layers = engine.cfg.num_layers
    print(f"\n{args.shape}, bucket {bucket}, median of {args.repeats} x 50 replays; step without ablation "
          f"{rows[0][1]:.1f} / {rows[-1][1]:.1f} us (first / last)")
    print("| left out | step us | saved us a step | saved us a layer |\n| --- | ---: | ---: | ---: |")
    for name, us in rows:
        print(f"| {name} | {us:.1f} | {base - us:.1f} | {(base - us) / layers:.2f} |")
    record = {"shape": args.shape, "bucket": bucket, "layers": layers,
              "rows": [{"ablation": n, "step_us": u} for n, u in rows]}
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    if args.plot:
        plot([record], args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

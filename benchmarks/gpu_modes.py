"""Per-bucket comparison of the engine's layer variants (GEMM / fusion modes) on BERT-base.

For each workload the engine (gemm="auto") captures one CUDA graph per mode that
can run the bucket and times its replays; this prints those times side by side
with HF SDPA FP16 under a CUDA graph (the issue's baseline). Then ablations on
batch 1 and 128 (the residual as a separate LayerNorm input instead of the GEMM's
C operand; cuBLAS GEMMs tuned by PyTorch's TunableOp), and the throughput of two
instances replaying batch-128 graphs concurrently on their own streams.

    PYTHONPATH=src python3 benchmarks/gpu_modes.py --out gpu_modes.json [--profile]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from surge.engines.torch_gpu import TorchEngine
from surge.types import Encoded, TokenBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_encoder import cuda_time, hf_graph  # noqa: E402  (same timer and HF graph as the main GPU benchmark)

VOCAB = 30522
WORKLOADS = [("b1_s32", [32]), ("b1_s16", [16]), ("b2_s32", [32] * 2), ("b4_s32", [32] * 4),
             ("b8_s16", [16] * 8), ("b16_s32", [32] * 16), ("b128_s32", [32] * 128)]


def batch_of(lengths, rng) -> TokenBatch:
    return TokenBatch.pack([Encoded(rng.integers(1000, VOCAB, size=n), np.zeros(n, dtype=np.int64)) for n in lengths])


def graph_of(engine: TorchEngine, batch: TokenBatch):
    engine.run(batch)
    key = engine.bucket(len(batch.lengths), int(batch.lengths.sum()), int(batch.lengths.max()))
    return key, engine._graph(key)


def hf_graph_ms(model, lengths) -> float:
    ids = torch.randint(1000, VOCAB, (len(lengths), max(lengths)), device="cuda")
    return cuda_time(hf_graph(model, ids, torch.ones_like(ids)), iters=100)


def two_streams_seq_per_s(engines, graphs, batch: int, rounds: int = 200) -> float:
    streams = [e.stream for e in engines]
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # warm, then timed
        for s in streams:
            s.wait_stream(main)
        start.record(main)
        for _ in range(rounds):
            for s, g in zip(streams, graphs):
                with torch.cuda.stream(s):
                    g.replay()
        for s in streams:
            main.wait_stream(s)
        end.record(main)
        end.synchronize()
    return rounds * len(engines) * batch / (start.elapsed_time(end) / 1e3)


def _tunable() -> None:
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.tuning_enable(True)
    torch.cuda.tunable.set_max_tuning_iterations(20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_modes.json")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp())
    BertModel(BertConfig(), add_pooling_layer=False).eval().save_pretrained(tmp)
    hf = BertModel.from_pretrained(tmp, attn_implementation="sdpa", dtype=torch.float16,
                                   add_pooling_layer=False).cuda().eval()
    engine = TorchEngine(device="cuda", precision="fp16", max_batch=128, batch_invariant=False)  # the per-bucket modes it times
    engine.load(tmp)
    rows = []
    for name, lengths in WORKLOADS:
        b = batch_of(lengths, rng)
        key, (graph, _, _, mode) = graph_of(engine, b)
        row = {"workload": name, "bucket": list(key), "chosen": mode, "modes_ms": engine.choices.get(key, {}),
               "surge_ms": cuda_time(graph.replay, iters=200, warmup=20), "hf_graph_ms": hf_graph_ms(hf, lengths)}
        row["seq_per_s"] = len(lengths) / row["surge_ms"] * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    # ablations on the two headline buckets, each mode fixed to what auto chose
    import surge.engines.encoder as enc

    chosen = {r["workload"]: r["chosen"] for r in rows}
    ablations = []
    for label, setup in [("residual as a separate LN input (before)", lambda: setattr(enc, "RESIDUAL_IN_GEMM", False)),
                         ("TunableOp-tuned cuBLAS GEMMs", _tunable)]:
        setup()
        for name, lengths in [("b1_s32", [32]), ("b128_s32", [32] * 128)]:
            e = TorchEngine(device="cuda", precision="fp16", max_batch=128, gemm=chosen[name])
            e.load(tmp)
            _, (graph, _, _, mode) = graph_of(e, batch_of(lengths, rng))
            ablations.append({"ablation": label, "workload": name, "mode": mode, "ms": cuda_time(graph.replay, iters=200, warmup=20)})
            print(json.dumps(ablations[-1]), flush=True)
            e.close()
        enc.RESIDUAL_IN_GEMM = True
        torch.cuda.tunable.enable(False)  # each ablation alone; later rows run untuned
    # two instances (shared weights, own workspaces and streams) replaying batch-128 graphs concurrently
    from surge.engines.memory import Workspace

    pair = [engine] + [TorchEngine(device="cuda", precision="fp16", max_batch=128, workspace=Workspace("cuda"))]
    pair[1].load(tmp)
    b = batch_of([32] * 128, rng)
    graphs = [graph_of(e, b)[1][0] for e in pair]
    one = 128 / cuda_time(graphs[0].replay, iters=200, warmup=20) * 1e3
    two = two_streams_seq_per_s(pair, graphs, 128)
    streams = {"one_stream_seq_per_s": one, "two_streams_seq_per_s": two, "gain": two / one}
    print(json.dumps(streams), flush=True)
    profile = {}
    if args.profile:
        from torch.profiler import ProfilerActivity, profile as prof_ctx

        for name, lengths in [("b1_s32", [32]), ("b128_s32", [32] * 128)]:
            _, (graph, _, _, mode) = graph_of(engine, batch_of(lengths, rng))
            torch.cuda.synchronize()
            with prof_ctx(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(10):
                    graph.replay()
                torch.cuda.synchronize()
            table = p.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=70)
            profile[name] = {"mode": mode, "table": table}
            print(f"--- {name} ({mode}), 10 replays\n{table}", flush=True)
    if engine.mode_errors:
        print("modes that failed to build:", json.dumps(engine.mode_errors, indent=1), flush=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "ablations": ablations, "mode_errors": engine.mode_errors, "streams": streams, "profile": profile}, indent=1))
    print("\n| workload | chosen | surge ms | HF+graph ms | x HF | seq/s | per mode (ms) |\n|---|---|---|---|---|---|---|")
    for r in rows:
        modes = ", ".join(f"{m} {v:.3f}" for m, v in sorted(r["modes_ms"].items(), key=lambda kv: kv[1]))
        print(f"| {r['workload']} | {r['chosen']} | {r['surge_ms']:.3f} | {r['hf_graph_ms']:.3f} | "
              f"{r['hf_graph_ms'] / r['surge_ms']:.2f} | {r['seq_per_s']:.0f} | {modes} |")
    print("\n| ablation | workload | mode | ms |\n|---|---|---|---|")
    for a in ablations:
        print(f"| {a['ablation']} | {a['workload']} | {a['mode']} | {a['ms']:.3f} |")
    print(f"\nbatch 128 x 32: one stream {one:.0f} seq/s, two instances on two streams {two:.0f} seq/s "
          f"({two / one:.2f}x)")


if __name__ == "__main__":
    main()

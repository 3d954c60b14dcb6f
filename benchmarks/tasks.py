"""Task models: surge against the baselines, in one run (numbers in docs/benchmarks.md, issue 17).

gpu (a CUDA machine): a BERT-base classifier with random weights (8 labels)
  * surge's GPU engine, fp16, the head inside the captured graph (run_heads), against
    transformers FP16 + CUDA graph (BertForSequenceClassification, static padded shapes,
    one torch.cuda.CUDAGraph per shape) and against surge's embedding engine on the same
    backbone (hidden states back to the host, mean pooling): batch 1 x 32 tokens and
    batch 64 of mixed lengths (8..128 tokens, seeded);
  * rerank: one query x 100 documents through the runtime (tokenize, batcher: 64 + 36,
    heads), a BERT-base cross-encoder (1 label, random), latency.
cpu (this 2-core machine): the trained intent classifier (tests/task_models.py) served end
  to end, `surge serve --engine torch --device cpu --precision bf16 --threads 1` (cache off)
  and with its cache on (default), against benchmarks/baselines/fastapi_pipeline.py (FastAPI +
  transformers pipeline), all POST /predict, 1 and 64 closed-loop clients, generated commands
  (which repeat, as assistant traffic does: 1229 of 4000 are distinct); besides req/s, each server's
  CPU time per request (process tree, user + system), which the machine's other load moves less.

    PYTHONPATH=src:. python3 benchmarks/tasks.py gpu [--tokenizer-dir DIR] [--out FILE.json]
heads (this machine): encode once, many heads: one backbone pass feeding intent + slots +
  embedding heads against the three models run separately, batch 1 and 32, ONNX Runtime and
  the torch CPU path, in-process (model time only).

    PYTHONPATH=src:. python3 benchmarks/tasks.py cpu [--seconds 20]
    PYTHONPATH=src:. python3 benchmarks/tasks.py heads [--reps 50] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
console = Console()


def _median_ms(fn, reps: int, warm: int = 5) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _lengths(n: int, lo: int, hi: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(lo, hi + 1, size=n)


def _items(lengths, vocab: int = 30522, seed: int = 1):
    from surge.types import Encoded

    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(1000, vocab, size=int(n), dtype=np.int64)
        ids[0], ids[-1] = 101, 102
        out.append(Encoded(ids, np.zeros_like(ids)))
    return out


# ------------------------------------------------------------------------------------ gpu
def _padded(items):
    """The items as transformers takes them: padded ids and attention mask on the GPU."""
    import torch

    seq = max(len(e.ids) for e in items)
    ids = torch.zeros(len(items), seq, dtype=torch.long)
    mask = torch.zeros(len(items), seq, dtype=torch.long)
    for i, e in enumerate(items):
        ids[i, :len(e.ids)] = torch.from_numpy(e.ids)
        mask[i, :len(e.ids)] = 1
    return ids.cuda(), mask.cuda()


def _hf_graph(model, items):
    """transformers FP16 forward captured in a CUDA graph for one static padded shape (the items'
    batch, padded to the longest); returns a callable that replays it and copies the logits to the host."""
    import torch

    ids, mask = _padded(items)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(s):
        for _ in range(3):
            model(input_ids=ids, attention_mask=mask)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = model(input_ids=ids, attention_mask=mask).logits

    def run():
        g.replay()
        return out.float().cpu().numpy()

    # The graph reads `ids` / `mask` at their captured addresses but holds no reference to them:
    # freed with this frame, their memory went back to the caching allocator and the replay read
    # whatever lay there as token ids (the 2026-12-01 `vectorized gather kernel index out of bounds`).
    run.static = (ids, mask, out)
    return run


def bench_gpu(args) -> dict:
    import torch
    import transformers
    from transformers import BertForSequenceClassification

    from surge.engines.heads import HeadSet, load_head
    from surge.engines.pooling import pool
    from surge.engines.torch_gpu import TorchEngine
    from surge.models import load_model_spec
    from surge.models.build import random_bert_base
    from surge.types import TokenBatch

    transformers.logging.set_verbosity_error()
    tok_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else None
    if tok_dir is None:
        from surge.models import bundled_model_dir

        tok_dir = bundled_model_dir()
    work = Path(tempfile.mkdtemp(prefix="surge-tasks-"))
    cls_dir = random_bert_base(work / "bert-base-cls", tok_dir, labels=8, seed=0)
    ce_dir = random_bert_base(work / "bert-base-ce", tok_dir, labels=1, seed=1)
    spec = load_model_spec(cls_dir)
    head = load_head(spec.path, spec.name, spec.task, spec.model_type, spec.labels)
    hs = HeadSet([head])
    cls_engine = TorchEngine(device="cuda", precision="fp16", max_batch=64)
    cls_engine.load(cls_dir)
    cls_engine.attach_heads(hs)
    emb_engine = TorchEngine(device="cuda", precision="fp16", max_batch=64)
    emb_engine.load(cls_dir)
    hf = BertForSequenceClassification.from_pretrained(str(cls_dir), dtype=torch.float16,
                                                       attn_implementation="sdpa").eval().cuda()
    hf32 = BertForSequenceClassification.from_pretrained(str(cls_dir), dtype=torch.float32).eval().cuda()
    shapes = {"batch 1 x 32": _lengths(1, 32, 32), "batch 64 mixed (8-128)": _lengths(64, 8, 128)}
    rows = []
    partial = {"gpu": torch.cuda.get_device_name(), "rows": rows}

    def save(stage: str) -> None:  # partial results survive a later failure
        console.print(f"[dim]stage done: {stage}[/]")
        if args.out:
            Path(args.out).write_text(json.dumps(partial, indent=2, default=float))

    for label, lengths in shapes.items():
        items = _items(lengths)
        batch = TokenBatch.pack(items)
        with torch.no_grad():  # correctness first: every row's logits vs transformers FP32 (a separate copy)
            ids, mask = _padded(items)
            want = hf32(input_ids=ids, attention_mask=mask).logits.float().cpu().numpy()
        got = np.asarray(cls_engine.run_heads(batch))
        err = float(np.abs(got - want).max())
        agree = float((got.argmax(-1) == want.argmax(-1)).mean())
        surge_ms = _median_ms(lambda: cls_engine.run_heads(batch), args.reps)
        emb_ms = _median_ms(lambda: pool(emb_engine.run(batch), batch, "mean"), args.reps)
        partial[label] = {"surge_classifier_ms": surge_ms, "surge_embedding_ms": emb_ms, "err": err}
        save(f"{label}: surge")
        hf_run = _hf_graph(hf, items)
        hf_err = float(np.abs(hf_run() - want).max())  # the baseline computes the same inputs
        hf_ms = _median_ms(hf_run, args.reps)
        rows.append({"shape": label, "surge_classifier_ms": surge_ms, "surge_embedding_ms": emb_ms,
                     "transformers_fp16_graph_ms": hf_ms, "classifier_vs_embedding": surge_ms / emb_ms,
                     "speedup_vs_transformers": hf_ms / surge_ms, "max_abs_logit_diff_vs_fp32": err,
                     "argmax_agreement_vs_fp32": agree, "transformers_fp16_max_abs_diff_vs_fp32": hf_err,
                     "tokens": int(lengths.sum())})
        save(f"{label}: transformers")
    del hf, hf32
    torch.cuda.empty_cache()
    rerank = _bench_rerank(ce_dir, args.reps)
    partial["rerank"] = rerank
    save("rerank")
    table = Table(title="Issue 17 GPU: BERT-base classifier (random weights, fp16)")
    for col in ("shape", "surge classifier ms", "surge embedding ms", "cls / emb", "transformers FP16+graph ms",
                "speed-up", "|Δlogit| vs FP32"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["shape"], f"{r['surge_classifier_ms']:.3f}", f"{r['surge_embedding_ms']:.3f}",
                      f"{r['classifier_vs_embedding']:.3f}", f"{r['transformers_fp16_graph_ms']:.3f}",
                      f"{r['speedup_vs_transformers']:.2f}x", f"{r['max_abs_logit_diff_vs_fp32']:.4f}")
    console.print(table)
    console.print(f"rerank 1 query x 100 documents (BERT-base cross-encoder, runtime path): "
                  f"p50 {rerank['p50_ms']:.2f} ms, p90 {rerank['p90_ms']:.2f} ms, batches {rerank['batches']}")
    out = {"gpu": torch.cuda.get_device_name(), "rows": rows, "rerank": rerank}
    return out


def _bench_rerank(ce_dir: Path, reps: int, device: str = "cuda") -> dict:
    """1 query x 100 documents through the runtime (tokenize, batcher, engine, heads), latency; the
    scores checked against transformers FP32 on the same pairs, and transformers FP16 (eager, one
    padded batch of 100, tokenizer included) timed beside it."""
    import asyncio

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from surge.cli.bootstrap import load_service
    from surge.config import BatchingConfig, CacheConfig, EngineConfig, ServerConfig
    from surge.data import load_sentences
    from surge.models import load_model_spec
    from surge.runtime.tasks import TaskRequest

    precision = "fp16" if device == "cuda" else "fp32"
    config = ServerConfig(engine=EngineConfig(engine="torch", device=device, precision=precision, max_batch_size=64,
                                              warmup_shapes=[(64, 64), (64, 32)]),
                          batching=BatchingConfig(max_batch_size=64, max_batch_tokens=16384),
                          cache=CacheConfig(enabled=False))
    service = load_service(config, load_model_spec(ce_dir))
    service.mark_ready()
    docs = load_sentences()[:100]
    query = "how are keyword arguments passed to a function"
    pairs = [(query, d) for d in docs]

    async def go():
        times = []
        for i in range(reps + 5):
            t = time.perf_counter()
            res = await service.infer(TaskRequest(pairs=pairs, truncate=True))
            if i >= 5:
                times.append(time.perf_counter() - t)
        assert len(res.outputs) == 100
        before = len(service.batcher.history)
        await service.infer(TaskRequest(pairs=pairs, truncate=True))
        batches = [b.size for b in list(service.batcher.history)[before:]]
        await service.close()
        return times, batches, res

    times, batches, res = asyncio.run(go())
    times.sort()
    got = np.array([float(np.asarray(o).reshape(-1)[0]) for o in res.outputs])
    tok = AutoTokenizer.from_pretrained(str(ce_dir))
    enc = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, truncation=True, return_tensors="pt")
    enc = {k: v.to(device) for k, v in enc.items()}
    m32 = AutoModelForSequenceClassification.from_pretrained(str(ce_dir), dtype=torch.float32).eval().to(device)
    with torch.no_grad():
        want = m32(**enc).logits.float().cpu().numpy()[:, 0]
    del m32
    out = {"p50_ms": times[len(times) // 2] * 1e3, "p90_ms": times[int(len(times) * 0.9)] * 1e3,
           "batches": batches, "max_abs_score_diff_vs_fp32": float(np.abs(got - want).max()),
           "top1_same_as_fp32": bool(int(got.argmax()) == int(want.argmax()))}
    if device == "cuda":
        m16 = AutoModelForSequenceClassification.from_pretrained(str(ce_dir), dtype=torch.float16,
                                                                 attn_implementation="sdpa").eval().cuda()

        def hf_rerank():
            e = tok([a for a, _ in pairs], [b for _, b in pairs], padding=True, truncation=True, return_tensors="pt")
            with torch.no_grad():
                return m16(**{k: v.cuda() for k, v in e.items()}).logits.float().cpu().numpy()

        out["transformers_fp16_eager_ms"] = _median_ms(hf_rerank, reps)
    return out


# ------------------------------------------------------------------------------------ cpu
def bench_cpu(args) -> dict:
    import os
    import subprocess

    import uvloop

    from surge.bench.servers import ServerProc, free_port
    from surge.models.finetune import heldout_commands
    from tests.http_load import closed_loop, encode_post
    from tests.server_process import ServerProcess
    from tests.task_models import task_models_dir

    model = task_models_dir() / "intent"
    # generated commands repeat as real assistant traffic does (templates x slot values): the cached
    # server sees those repeats; the cache-off server and the baseline compute every request
    queries = heldout_commands(4000, seed=11)
    wire = [encode_post("127.0.0.1", "/predict", {"inputs": q}) for q in queries]
    port = free_port()
    baseline = ServerProc("fastapi-pipeline", [sys.executable, str(Path(__file__).parent / "baselines" /
                                                                   "fastapi_pipeline.py"),
                                               "--port", str(port), "--model-dir", str(model)], port,
                          ready_timeout_s=180, env=dict(os.environ))
    flags = ("--engine", "torch", "--device", "cpu", "--precision", "bf16", "--threads", "1",
             "--max-queue-delay-ms", "2")
    surge = ServerProcess(str(model), *flags, "--cache-bytes", "0")
    cached = ServerProcess(str(model), *flags)
    rows = []
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    try:
        for srv in (surge, cached, baseline):
            srv.start()
        for clients in (1, 64):
            res = {}
            for name, srv in (("surge", surge), ("cached", cached), ("baseline", baseline)):
                uvloop.run(closed_loop(srv.url, wire, clients, duration=2.0))
                rps, lat = [], []
                cpu0 = _cpu_seconds(srv.pid())
                for _ in range(args.rounds):  # alternating rounds: drifting background load hits both
                    r = uvloop.run(closed_loop(srv.url, wire, clients, duration=args.seconds / args.rounds))
                    assert r.ok == len(r.latencies), r.statuses
                    rps.append(r.throughput)
                    lat += r.latencies
                cpu = (_cpu_seconds(srv.pid()) - cpu0) / len(lat) * 1e3
                lat.sort()
                res[name] = {"rps": statistics.median(rps), "p50_ms": lat[len(lat) // 2] * 1e3,
                             "p99_ms": lat[int(len(lat) * 0.99)] * 1e3, "cpu_ms_per_req": cpu}
            rows.append({"clients": clients, **{f"{k}_{m}": v for k, d in res.items() for m, v in d.items()},
                         "ratio": res["surge"]["rps"] / res["baseline"]["rps"],
                         "ratio_cached": res["cached"]["rps"] / res["baseline"]["rps"]})
    finally:
        for srv in (surge, cached, baseline):
            srv.stop()
    table = Table(title="Issue 17 CPU (2 cores): intent classifier end to end, POST /predict")
    for col in ("clients", "surge (cache off) req/s", "p50 / p99 ms", "CPU ms/req", "surge (cache on) req/s",
                "p50 / p99 ms", "baseline req/s", "p50 / p99 ms", "CPU ms/req", "off / baseline", "on / baseline"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["clients"]), f"{r['surge_rps']:.1f}", f"{r['surge_p50_ms']:.1f} / {r['surge_p99_ms']:.0f}",
                      f"{r['surge_cpu_ms_per_req']:.2f}", f"{r['cached_rps']:.1f}",
                      f"{r['cached_p50_ms']:.1f} / {r['cached_p99_ms']:.0f}", f"{r['baseline_rps']:.1f}",
                      f"{r['baseline_p50_ms']:.1f} / {r['baseline_p99_ms']:.0f}", f"{r['baseline_cpu_ms_per_req']:.2f}",
                      f"{r['ratio']:.1f}x", f"{r['ratio_cached']:.1f}x")
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    console.print(table)
    console.print(f"load before the run: {load}\nload after the run: {after}")
    return {"rows": rows, "uptime": load, "uptime_after": after, "surge_flags": list(flags)}


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a server process and its children so far: the cost of a request
    in CPU, which the machine's other load shifts far less than the wall-clock throughput."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return sum(t.user + t.system for t in (p.cpu_times() for p in procs))


def bench_heads(args) -> dict:
    """Encode once, many heads: one worker with intent + slots + embedding heads on one backbone pass
    against the three models run separately (three workers, three backbone passes), same inputs,
    in-process (tokenized once, outside the timing), per engine."""
    import subprocess

    from surge.cli.bootstrap import resolve_artifact
    from surge.config import EngineConfig, HeadFile, default_cache_dir
    from surge.models import bundled_model_dir, load_model_spec
    from surge.models.finetune import heldout_commands
    from surge.runtime.loader import build_worker
    from tests.task_models import task_models_dir

    models = task_models_dir()
    heads = [HeadFile(name="intent", task="classify", source=str(models / "intent")),
             HeadFile(name="slots", task="token-classify", source=str(models / "slots")),
             HeadFile(name="embed", task="embed")]
    cache = default_cache_dir()
    rows = []
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    for engine in ("onnxrt", "torch"):
        cfg = EngineConfig(engine=engine, threads=args.threads, warmup_shapes=[[1, 16]])

        def worker(path, hs=None, name=None):
            spec = load_model_spec(path, name=name)
            return build_worker(spec, resolve_artifact(spec, cfg, cache, backbone=bool(hs)), cfg, heads=hs)

        multi = worker(bundled_model_dir(), heads, "assistant")
        alone = [worker(models / "intent"), worker(models / "slots"), worker(bundled_model_dir())]
        tok = multi.tokenizer
        for batch in (1, 32):
            texts = heldout_commands(batch, seed=5 + batch)
            items = tok.to_encoded(tok.encodings(texts))
            t_multi, t_alone = [], []
            for _ in range(args.rounds):  # alternating: drifting background load hits both
                t_multi.append(_median_ms(lambda: multi.compute(items), args.reps))
                t_alone.append(_median_ms(lambda: [w.compute(items) for w in alone], args.reps))
            m, a = statistics.median(t_multi), statistics.median(t_alone)
            rows.append({"engine": engine, "batch": batch, "tokens": int(sum(len(e) for e in items)),
                         "multi_ms": m, "separate_ms": a, "speedup": a / m})
        for w in [multi, *alone]:
            w.engines.close()
    table = Table(title=f"Encode once, many heads (intent + slots + embedding), {args.threads} thread(s)")
    for col in ("engine", "batch", "tokens", "one backbone, 3 heads (ms)", "3 models separately (ms)", "speedup"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["engine"], str(r["batch"]), str(r["tokens"]), f"{r['multi_ms']:.2f}",
                      f"{r['separate_ms']:.2f}", f"{r['speedup']:.2f}x")
    console.print(table)
    console.print(f"load before the run: {load}")
    return {"rows": rows, "uptime": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["gpu", "cpu", "heads"])
    p.add_argument("--tokenizer-dir", default=None, help="gpu: a directory with the BERT tokenizer (default: bundled)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="heads: engine threads")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = {"gpu": bench_gpu, "cpu": bench_cpu, "heads": bench_heads}[args.mode](args)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=float))


if __name__ == "__main__":
    main()

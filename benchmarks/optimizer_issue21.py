"""Issue 21 numbers: INT8 on the held-out queries (with intervals), batch invariance, retrieval as the
issue measured it, the distilled student against its teacher, and `surge serve --artifact` FP32 vs INT8
end to end at 64 clients (surge's own load generator).

    PYTHONPATH=src python benchmarks/optimizer.py --issue21 [--student DIR] [--int8-artifact DIR] [--duration 20]

The end-to-end row alone (builds both artifacts with default settings unless given, then serves each
`--serve-runs` times, FP32 and INT8 alternating, and reports every run's ratio and the median):

    PYTHONPATH=src python benchmarks/optimizer.py --issue21 --serve-only --serve-runs 3 --workdir /tmp/i21-serve

Run through benchmarks/optimizer.py (--issue21). Everything runs on this machine in this process, except the
servers (one at a time, each its own process) and their load generator.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np


def _embed(model_bytes: bytes, spec, texts: list[str], threads: int, layout: str = "sorted") -> np.ndarray:
    from surge.optimize.validate import Encoded, run_model, session

    return run_model(session(model_bytes, threads), spec, Encoded(spec, texts, layout=layout)).embeddings


def _cos(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def retrieval(ref_q, ref_d, cand_q, cand_d, tolerance=0.01) -> dict:
    """Top-1 document agreement of queries over a disjoint document set, strict and within `tolerance`."""
    from surge.optimize.validate import wilson_interval

    def norm(x):
        x = x.astype(np.float64)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    rs, cs = norm(ref_q) @ norm(ref_d).T, norm(cand_q) @ norm(cand_d).T
    best, pick = rs.argmax(1), cs.argmax(1)
    strict = float((best == pick).mean())
    tie = float((rs[np.arange(len(rs)), pick] >= rs.max(1) - tolerance).mean())
    n = len(rs)
    return {"queries": n, "documents": len(ref_d), "top1": strict, "top1_ci95": wilson_interval(round(strict * n), n),
            "top1_tie": tie, "top1_tie_ci95": wilson_interval(round(tie * n), n)}


def invariance(model_bytes: bytes, spec, probes: list[str], neighbours: list[str], threads: int) -> dict:
    """Each probe alone vs at a random position among long neighbours (one padded batch)."""
    from surge.engines.pooling import l2_normalize, pool
    from surge.optimize.validate import encode_texts, session
    from surge.types import TokenBatch

    sess = session(model_bytes, threads)
    names = {i.name for i in sess.get_inputs()}

    def emb(texts):
        b = TokenBatch.pad(encode_texts(spec, texts), pad_id=spec.pad_token_id)
        feeds = {k: v for k, v in (("input_ids", b.input_ids), ("attention_mask", b.attention_mask),
                                   ("token_type_ids", b.token_type_ids)) if k in names}
        return l2_normalize(pool(sess.run(None, feeds)[0], b, spec.pooling))

    rng = np.random.default_rng(0)
    alone, batched = [], []
    for t in probes:
        batch = list(neighbours)
        pos = int(rng.integers(0, len(batch) + 1))
        batch.insert(pos, t)
        alone.append(emb([t])[0])
        batched.append(emb(batch)[pos])
    cos = _cos(np.stack(alone), np.stack(batched))
    return {"probes": len(probes), "neighbours": len(neighbours), "min_cosine": float(cos.min()),
            "mean_cosine": float(cos.mean()), "max_abs_diff": float(np.abs(np.stack(alone) - np.stack(batched)).max())}


def _process_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its waited-for children (utime + stime + cutime + cstime, /proc)."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def serve_and_bench(artifact: Path, name: str, clients: int, duration: float, threads: int | None, queries: Path,
                    out: Path, extra: tuple[str, ...] = ()) -> dict:
    """One server, one closed-loop run. Besides req/s (what the target is about, and on a shared VM as noisy as
    its neighbours), each side's CPU a request: the server's process over the generator's whole run (warm-up
    included) and the generator's own (`surge bench`'s report): CPU time a request moves far less with a
    neighbour's load than throughput does. `threads` None: no --threads, so the server runs the engine layout the
    artifact's manifest records (optimize/serving_layout.py) unless `extra` sets one."""
    from surge.bench.servers import ServerProc, free_port, surge_serve_argv

    port = free_port()
    given = ("--threads", str(threads)) if threads else ()
    argv = surge_serve_argv(port, "--artifact", str(artifact), *given, "--cache-bytes", "0", *extra)
    with ServerProc(name, argv, port) as srv:  # __enter__ starts it and waits until ready
        report = out / f"bench-{name}.json"
        cmd = [sys.executable, "-m", "surge.cli.main", "bench", "run", srv.url, "-p", "openai", "-c", str(clients),
               "-d", str(duration), "--warmup", "5", "--query-log", str(queries), "--json", str(report),
               "--no-progress", "--name", name]
        cpu0 = _process_cpu_s(srv.proc.pid)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        server_cpu = _process_cpu_s(srv.proc.pid) - cpu0
    run = json.loads(report.read_text())["runs"][name][0]
    sent = run["requests"] + run.get("warmup_requests", 0)
    return {"throughput_rps": run["throughput_rps"], "p50_ms": run["latency_ms"]["p50"],
            "p99_ms": run["latency_ms"]["p99"], "errors": run["error_count"], "requests": run["requests"],
            "server_cpu_ms_per_request": server_cpu * 1000 / sent if sent else None,
            "generator_cpu_ms_per_request": run.get("generator_cpu_ms_per_request")}


def _cpu_ratio(run: dict) -> float | None:
    """FP32's CPU a request over INT8's, server and generator together (None where not measured)."""
    def total(side):
        return (side.get("server_cpu_ms_per_request") or 0) + (side.get("generator_cpu_ms_per_request") or 0)

    return total(run["fp32"]) / total(run["int8"]) if total(run["int8"]) and total(run["fp32"]) else None


def main(args, console) -> dict:
    import os

    from rich.table import Table

    from surge.data import calibration_queries, heldout_queries
    from surge.models import bundled_model_dir, load_model_spec
    from surge.optimize.pipeline import GateFailed, OptimizeOptions, optimize
    from surge.optimize.quantize import quantize_int8
    from surge.optimize.serving_layout import layout_hint

    import onnx

    cache = Path(os.environ.get("SURGE_CACHE_DIR", Path.home() / ".cache" / "surge"))
    spec = load_model_spec(bundled_model_dir())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="surge-i21-"))
    results: dict = {"workdir": str(work)}
    threads = args.threads or 2

    # 1. INT8 (defaults: per-row, full corpus) and FP32 artifacts through the real pipeline.
    arts = {}
    for precision in ("int8", "fp32"):
        given = getattr(args, f"{precision}_artifact", None)
        out = Path(given) if given else work / f"minilm-{precision}"
        if not given and (out / "manifest.json").is_file():
            console.print(f"reusing {out} (delete it to optimize afresh)")
        elif not given:
            console.print(f"surge optimize --precision {precision} (shipped queries)")
            few = {} if precision == "int8" else {"calibration": calibration_queries()[:200], "heldout": heldout_queries()[:200]}
            try:
                optimize(spec, out, OptimizeOptions(precision=precision, threads=threads, force=True, **few), cache)
            except GateFailed:
                pass
        arts[precision] = out
    manifest = json.loads((arts["int8"] / "manifest.json").read_text())
    results["int8_manifest"] = {k: manifest[k] for k in ("validation", "latency")}
    results["int8_kept_fp32"] = manifest["precision_decisions"]["quantization"].get("kept_fp32")
    results["int8_alpha"] = manifest["precision_decisions"]["quantization"]["smoothing"].get("alpha")

    # 2. The dynamic (per-tensor) INT8 of the same FP32 graph, for comparison.
    fp32_model = onnx.load(str(arts["fp32"] / "model.onnx"))
    dynamic = quantize_int8(fp32_model, per_channel=True)[0].SerializeToString()
    per_row = (arts["int8"] / "model.onnx").read_bytes()
    fp32 = fp32_model.SerializeToString()

    held = heldout_queries()
    previous = work / "issue21.json"
    if args.serve_only and previous.exists():
        results = {**json.loads(previous.read_text()), **{k: v for k, v in results.items() if k != "models"}}
    results.pop("serve", None)
    # 3. Batch invariance and the retrieval protocol (queries over disjoint documents).
    long = sorted(calibration_queries(), key=len)[-3:]
    probes = held[:64]
    q_texts, d_texts = held[:900], held[900:]
    if not args.serve_only:
        ref_q, ref_d = _embed(fp32, spec, q_texts, threads), _embed(fp32, spec, d_texts, threads)
    for name, model in () if args.serve_only else (("fp32", fp32), ("int8 per-row (surge default)", per_row),
                                                    ("int8 dynamic per-tensor", dynamic)):
        console.print(f"invariance and retrieval: {name}")
        inv = invariance(model, spec, probes, long, threads)
        cq = _embed(model, spec, q_texts, threads, layout="serving")
        cd = _embed(model, spec, d_texts, threads, layout="serving")
        results.setdefault("models", {})[name] = {
            "invariance": inv, "retrieval": retrieval(ref_q, ref_d, cq, cd),
            "heldout_cosine": {"mean": float(np.concatenate([_cos(ref_q, cq), _cos(ref_d, cd)]).mean()),
                               "min": float(np.concatenate([_cos(ref_q, cq), _cos(ref_d, cd)]).min())}}

    # 4. The distilled student (its own gate report, written by `surge distill`).
    if args.student:
        results["student"] = json.loads((Path(args.student) / "distill.json").read_text())
        results["student"].pop("losses", None)

    # 5. End to end: surge serve --artifact, FP32 vs INT8, closed loop, N clients, no cache.
    work.mkdir(parents=True, exist_ok=True)  # --serve-only skips the steps that made it
    qfile = work / "heldout.txt"
    qfile.write_text("\n".join(held) + "\n")
    if args.clients:
        import os as _os

        # Alternating runs: a neighbour's burst of load lands on both models, and each run's ratio is reported.
        runs = []
        for r in range(max(1, args.serve_runs)):
            run = {"load_average_before": _os.getloadavg()[0]}
            for name in ("fp32", "int8"):
                console.print(f"run {r + 1}: surge serve --artifact {name}: {args.clients} clients, {args.duration:.0f} s")
                # --threads only where asked: unset, each server runs its artifact's measured layout
                run[name] = serve_and_bench(arts[name], name, args.clients, args.duration, args.threads or None, qfile, work,
                                            tuple(shlex.split(getattr(args, "serve_args", "") or "")))
            run["int8_over_fp32"] = run["int8"]["throughput_rps"] / run["fp32"]["throughput_rps"]
            run["cpu_fp32_over_int8"] = _cpu_ratio(run)
            run["load_average_after"] = _os.getloadavg()[0]
            runs.append(run)
        mid = sorted(runs, key=lambda x: x["int8_over_fp32"])[len(runs) // 2]
        cpu = sorted(x["cpu_fp32_over_int8"] for x in runs if x["cpu_fp32_over_int8"])
        results["serve"] = {"clients": args.clients, "duration_s": args.duration, "runs": runs,
                            "serve_args": getattr(args, "serve_args", "") or "",
                            "layouts": {name: layout_hint(arts[name]) for name in ("fp32", "int8")},
                            "fp32": mid["fp32"], "int8": mid["int8"], "int8_over_fp32": mid["int8_over_fp32"],
                            "median_of": len(runs), "target": 1.8,
                            "cpu_fp32_over_int8_median": cpu[len(cpu) // 2] if cpu else None}

    _print(console, results)
    (work / "issue21.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def _print(console, r: dict) -> None:
    from rich.table import Table

    v = r["int8_manifest"]["validation"]
    t = Table(title="INT8 (surge optimize defaults) vs FP32, shipped queries")
    for col in ("set", "n", "mean cos", "worst 1%", "min cos", "top-1 strict [95% CI]", "top-1 ties [95% CI]"):
        t.add_column(col, justify="right")
    for name, m in v["sets"].items():
        ci, sci = m["top1_tie_ci95"], m.get("top1_ci95") or (float("nan"), float("nan"))
        t.add_row(name, str(m["n"]), f"{m['mean_cosine']:.5f}", f"{m['tail_cosine']:.5f}", f"{m['min_cosine']:.5f}",
                  f"{m['top1']:.4f} [{sci[0]:.4f}, {sci[1]:.4f}]", f"{m['top1_tie']:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]")
    console.print(t)
    console.print(f"gate passed: {v['passed']} {v['failures']}; kept FP32: {r['int8_kept_fp32']}; alpha {r['int8_alpha']}")
    t = Table(title="batch invariance and retrieval (900 held-out queries over 1,815 held-out documents)")
    for col in ("model", "alone vs batched min cos", "max |Δ|", "top-1", "top-1 95% CI", "top-1 ties", "min cos"):
        t.add_column(col, justify="right")
    for name, m in r.get("models", {}).items():
        ret = m["retrieval"]
        t.add_row(name, f"{m['invariance']['min_cosine']:.6f}", f"{m['invariance']['max_abs_diff']:.1e}",
                  f"{ret['top1']:.4f}", f"[{ret['top1_ci95'][0]:.4f}, {ret['top1_ci95'][1]:.4f}]",
                  f"{ret['top1_tie']:.4f}", f"{m['heldout_cosine']['min']:.4f}")
    console.print(t)
    lat = r["int8_manifest"]["latency"]
    if lat.get("measured"):
        for row in lat["rows"]:
            console.print(f"latency gate {row['batch']}x{row['seq']}: FP32 {row['source_ms']:.2f} ms "
                          f"[{row['source_p25']:.2f}-{row['source_p75']:.2f}], INT8 {row['optimized_ms']:.2f} ms "
                          f"[{row['optimized_p25']:.2f}-{row['optimized_p75']:.2f}], {row['speedup']:.2f}x")
    if "student" in r:
        s = r["student"]
        h = s["gate"]["sets"]["heldout"]
        console.print(f"student {s['student_layers']}/{s['teacher_layers']} layers (kept {s['kept_layers']}), "
                      f"{s['steps']} steps in {s['seconds']:.0f} s: held-out mean cos {h['mean_cosine']:.4f}, "
                      f"min {h['min_cosine']:.4f}, top-1 {h['top1']:.3f}, ties {h['top1_tie']:.3f}; "
                      f"gate {s['gate']['passed']}")
        for row in (s.get("latency") or {}).get("rows", []):
            console.print(f"  student latency {row['batch']}x{row['seq']}: teacher {row['source_ms']:.2f} ms, "
                          f"student {row['optimized_ms']:.2f} ms, {row['speedup']:.2f}x")
    if "serve" in r:
        for name in ("fp32", "int8"):
            s = r["serve"][name]
            hint = (r["serve"].get("layouts") or {}).get(name)
            how = r["serve"].get("serve_args") or (f"{hint['instances']} x {hint['threads']} thread(s), measured layout"
                                                   if hint else "server defaults")
            console.print(f"serve {name} ({how}): {s['throughput_rps']:.1f} req/s, p50 {s['p50_ms']:.1f} ms, "
                          f"p99 {s['p99_ms']:.1f} ms, errors {s['errors']}")
        runs = r["serve"].get("runs", [])
        console.print("per run INT8 / FP32: " + ", ".join(f"{x['int8_over_fp32']:.2f}x (load {x['load_average_before']:.1f})"
                                                          for x in runs))
        console.print(f"INT8 / FP32 throughput, median run of {len(runs)}: {r['serve']['int8_over_fp32']:.2f}x (target >= 1.8x)")
        for x in runs:
            f, i = x["fp32"], x["int8"]
            if f.get("server_cpu_ms_per_request"):
                console.print(f"  CPU a request, server + generator: FP32 {f['server_cpu_ms_per_request']:.2f} + "
                              f"{f['generator_cpu_ms_per_request'] or 0:.2f} ms, INT8 {i['server_cpu_ms_per_request']:.2f} + "
                              f"{i['generator_cpu_ms_per_request'] or 0:.2f} ms: {x['cpu_fp32_over_int8']:.2f}x")
        if r["serve"].get("cpu_fp32_over_int8_median"):
            console.print(f"FP32 / INT8 CPU a request (server + generator), median run: "
                          f"{r['serve']['cpu_fp32_over_int8_median']:.2f}x")

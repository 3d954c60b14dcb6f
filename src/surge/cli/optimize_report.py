"""The rich tables `surge optimize` ends with."""

from __future__ import annotations

from rich.table import Table


def render(console, manifest: dict, reports, explain: bool) -> None:
    nodes = manifest.get("nodes", {})
    summary = Table(title=f"surge optimize: {manifest.get('model_name')} → {manifest.get('precision')} ({manifest.get('target')})")
    summary.add_column("item")
    summary.add_column("value")
    if nodes:
        ratio = nodes["before"] / max(nodes["after"], 1)
        summary.add_row("nodes", f"{nodes['before']} → {nodes['after']} ({ratio:.1f}x fewer)")
    decisions = manifest.get("precision_decisions", {})
    if "block_list" in decisions:
        summary.add_row("kept in FP32", ", ".join(decisions["block_list"]) or "(nothing)")
    if "search" in decisions:
        sens = decisions["search"]["sensitivity"]
        summary.add_row("sensitivity (1-cos)", ", ".join(f"{k}={v:.1e}" for k, v in sorted(sens.items(), key=lambda kv: -kv[1])))
    if "quantization" in decisions:
        q = decisions["quantization"]
        ops = q.get("int8_ops") or q.get("quantized_ops")
        summary.add_row("int8", f"{q.get('method', 'dynamic')}: {ops} ({'per-channel' if q['per_channel'] else 'per-tensor'} weights;"
                                f" activations {q.get('activation_type', '?')})")
        if "smoothing" in q:
            alpha = q["smoothing"].get("alpha")
            summary.add_row("smoothing (SmoothQuant)", "off" if alpha is None else
                            f"alpha {alpha}: {q['smoothing']['muls_inserted']} Mul inserted, {q['smoothing']['folded_into_v']} folded into V")
            summary.add_row("int8 nodes kept in FP32", ", ".join(q.get("kept_fp32", [])) or "(none)")
    if "pruning" in manifest:
        p = manifest["pruning"]
        summary.add_row("pruned heads", f"{p['heads_removed']} of {p['heads_total']} ({p['heads_per_layer']} per layer left)")
    validation = manifest.get("validation", {})
    if validation:
        summary.add_row("executed", validation.get("executed", ""))
        if validation.get("int8_products"):
            summary.add_row("int8 products", validation["int8_products"])
        verdict = "[green]passed[/]" if validation["passed"] else "[red]FAILED: " + "; ".join(validation["failures"]) + "[/]"
        summary.add_row("accuracy gate", verdict)
    console.print(summary)

    if validation.get("sets"):
        acc = Table(title="accuracy vs FP32 source")
        cols = {"argmax": "argmax", "rank_top1": "rank top-1", "ndcg10": "NDCG@10", "rank_tau": "rank tau",
                "rank_score": "score 1-|Δ|", "tokens": "token labels", "kappa": "kappa (labels beyond chance)"}
        task_cols = [k for k in cols if any(m.get(k) is not None for m in validation["sets"].values())]
        for col in ("set", "n", "mean cos", "worst 1% cos", "min cos", "max |Δ|", "top-1 strict [95% CI]", "top-1 (ties) [95% CI]",
                    *[cols[k] for k in task_cols or ["argmax"]]):
            acc.add_column(col, justify="right")

        def f3(v):  # task graphs have no nearest-neighbour top-1 (None)
            return "-" if v is None else f"{v:.3f}"

        for name, m in validation["sets"].items():
            ci, sci = m.get("top1_tie_ci95"), m.get("top1_ci95")
            tail = m.get("tail_cosine")
            acc.add_row(name, str(m["n"]), f"{m['mean_cosine']:.6f}", "-" if tail is None else f"{tail:.6f}",
                        f"{m['min_cosine']:.6f}", f"{m['max_abs_diff']:.2e}",
                        f3(m["top1"]) + (f" [{sci[0]:.3f}, {sci[1]:.3f}]" if sci else ""),
                        f3(m["top1_tie"]) + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else ""),
                        *[f3(m.get(k)) for k in task_cols or ["argmax"]])
        console.print(acc)
    q = manifest.get("precision_decisions", {}).get("quantization") or {}
    if q.get("method"):
        kept = q.get("kept_fp32") or []
        rounding = (q.get("weight_rounding") or {}).get("chosen")
        if rounding:
            console.print(f"int8 weight rounding: {rounding}; GELU inputs on the unsigned grid: "
                          f"{q.get('unsigned_gelu_inputs', 0)}")
        split = (q.get("outlier_split") or {})
        if split.get("chosen"):
            b, a = split["before"], split["after"]
            console.print(f"int8 outlier split: each node's {split['channels']} largest input channels in FP32 "
                          f"(calibration mean cos {b['mean_cosine']:.5f} -> {a['mean_cosine']:.5f}, strict top-1 "
                          f"{b['top1']:.4f} -> {a['top1']:.4f})")
        console.print(f"int8 {q['method']}: batch invariant {q.get('batch_invariant', False)}; "
                      f"smoothing alpha {q.get('smoothing', {}).get('alpha')}; "
                      f"kept in FP32: {', '.join(kept) if kept else 'none'}")
    latency = manifest.get("latency", {})
    if latency.get("measured"):
        lat = Table(title=f"latency, ONNX Runtime CPU (median ms over {latency.get('rounds', '?')} interleaved rounds, "
                          "in brackets p25-p75)")
        for col in ("batch", "seq", "FP32 source", "optimized", "speedup", "faster?"):
            lat.add_column(col, justify="right")
        for row in latency["rows"]:
            spread = lambda r, k: f" [{r[k + '_p25']:.2f}-{r[k + '_p75']:.2f}]" if k + "_p25" in r else ""
            lat.add_row(str(row["batch"]), str(row["seq"]), f"{row['source_ms']:.2f}" + spread(row, "source"),
                        f"{row['optimized_ms']:.2f}" + spread(row, "optimized"), f"{row['speedup']:.2f}x",
                        {True: "[green]yes[/]", False: "[red]no[/]"}.get(row.get("faster"), "-"))
        console.print(lat)
        gate = latency.get("gate")
        if gate:
            verdict = "[green]passed[/]" if gate["passed"] else "[red]FAILED[/]"
            console.print(f"latency gate: {verdict} ({gate['rule']})")
    elif latency:
        console.print(f"latency not measured: {latency.get('why')}")
    serving = manifest.get("serving")
    if serving:
        per = ", ".join(f"{k}: {v:.2f}" for k, v in serving["ms_per_query"].items())
        console.print(f"serving batch size: {serving['max_batch_size']} (ms a query by batch size, "
                      f"{serving.get('batch_threads', 1)} thread: {per}); `surge serve --artifact` caps its batches "
                      "there unless told otherwise")
        layout = serving.get("layout")
        if layout and "instances" in serving:
            rows = ", ".join(f"{r['instances']} x {r['threads']}: {r['ms']:.3f}" for r in layout["ms_per_query"])
            console.print(f"serving layout: {serving['instances']} session(s) x {serving['threads']} thread(s) (ms a "
                          f"query at {layout['batch_size']} a batch on {layout['cores']} cores, sessions x threads: "
                          f"{rows}); `surge serve --artifact` runs its engine so unless --threads or --instances is set")

    if explain:
        table = Table(title="passes")
        for col in ("pass", "nodes", "changes", "what changed"):
            table.add_column(col)
        for r in reports:
            delta = ", ".join(f"{k} {v:+d}" for k, v in r.op_delta.items())
            table.add_row(r.name, f"{r.nodes_before} → {r.nodes_after}", str(r.changes),
                          "; ".join(r.details) + (f"\n[dim]{delta}[/]" if delta else ""))
        console.print(table)

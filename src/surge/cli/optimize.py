"""`surge optimize MODEL_DIR -o ARTIFACT_DIR`: graph passes, precision, validation, report."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from surge.config import default_cache_dir


def register(app: typer.Typer) -> None:
    app.command("optimize")(optimize)


def optimize(
    model_dir: Optional[Path] = typer.Argument(None, help="Hugging Face model directory (default: the bundled all-MiniLM-L6-v2)."),
    output: Path = typer.Option(..., "-o", "--output", help="Artifact directory to write."),
    target: str = typer.Option("cpu", envvar="SURGE_TARGET", help="cpu (ONNX Runtime engine) or gpu."),
    precision: str = typer.Option("fp32", envvar="SURGE_PRECISION", help="fp32, fp16, bf16 or int8."),
    auto_block_list: bool = typer.Option(False, "--auto-block-list", help="Search the smallest FP32 block list meeting the budget (fp16/bf16)."),
    block: Optional[list[str]] = typer.Option(None, "--block", help="Op type kept in FP32 (repeatable; replaces the default block list)."),
    per_channel: bool = typer.Option(True, "--per-channel/--per-tensor", help="INT8 weight scales per output channel or per tensor."),
    smooth_alpha: str = typer.Option("auto", "--smooth-alpha", help="INT8 SmoothQuant strength: auto (measured on calibration text), off, or a number in (0, 1]."),
    int8_fallback: bool = typer.Option(True, "--int8-fallback/--no-int8-fallback", help="INT8: keep the most sensitive MatMuls in FP32 (at most 1/4) until the calibration budget (min cosine, strict top-1) is met."),
    prune_heads: float = typer.Option(0.0, "--prune-heads", help="Fraction of attention heads to remove (least important on calibration text)."),
    rule: Optional[list[str]] = typer.Option(None, "--rule", help="Extra rewrite rule(s) by import path, package.module:name (repeatable)."),
    min_cosine: Optional[float] = typer.Option(None, "--min-cosine", help="Override the budget's mean-cosine floor."),
    min_top1: Optional[float] = typer.Option(None, "--min-top1", help="Override the budget's retrieval top-1 floor, near-ties (within 0.01) counted as agreeing."),
    min_top1_strict: Optional[float] = typer.Option(None, "--min-top1-strict", help="Override the budget's strict retrieval top-1 floor (int8: 0.98)."),
    min_kappa: Optional[float] = typer.Option(None, "--min-kappa", help="Override the budget's floor on Cohen's kappa of the labels (classify / token-classify; int8: 0.9)."),
    min_rank_top1: float | None = typer.Option(None, "--min-rank-top1", help="Reranker: override the floor on each query's best document agreeing (int8: 0.9)."),
    min_ndcg10: float | None = typer.Option(None, "--min-ndcg10", help="Reranker: override the floor on NDCG@10 of the ranking, graded by the source's (int8: 0.95)."),
    min_rank_tau: float | None = typer.Option(None, "--min-rank-tau", help="Reranker: override the floor on the weighted Kendall tau of each query's ranking, mean over queries (int8: 0.6)."),
    min_rank_score: float | None = typer.Option(None, "--min-rank-score", help="Reranker: override the floor on 1 - the largest change of a served relevance score (sigmoid; int8: 0.95)."),
    max_sentences: int = typer.Option(0, "--max-sentences", help="Use only the first N calibration and N held-out sentences (0: all 904 + 2,715 shipped queries)."),
    int8_outliers: int = typer.Option(4, "--int8-outliers", min=0, help="Per-row INT8: try computing each MatMul's N largest input channels in FP32 beside the int8 product (kept if better on calibration; 0: never)."),
    int8_method: str = typer.Option("per-row", "--int8-method", help="INT8 activations: per-row (one scale per token, batch invariant) or dynamic (ORT per tensor, batch dependent)."),
    explain: bool = typer.Option(False, "--explain", help="List what each pass changed."),
    force: bool = typer.Option(False, "--force", help="Write the artifact even if it misses its accuracy budget."),
    no_latency: bool = typer.Option(False, "--no-latency", help="Skip the latency comparison (and its gate)."),
    shapes: str = typer.Option("1x32,8x64", "--shapes", help="Serving shapes BATCHxSEQ the latency gate measures (comma-separated)."),
    min_speedup: float = typer.Option(1.0, "--min-speedup", help="Latency gate: the artifact must beat its source by more than this factor at every shape (0: measure only)."),
    threads: int = typer.Option(0, envvar="SURGE_THREADS", help="ONNX Runtime threads for validation (0: all cores)."),
    cache_dir: Optional[Path] = typer.Option(None, envvar="SURGE_CACHE_DIR", help="Where FP32 exports are cached."),
) -> None:
    """Optimize a model into a validated artifact that `surge serve --artifact` serves."""
    from rich.console import Console

    from surge.errors import SurgeError
    from surge.models import bundled_model_dir, load_model_spec
    from surge.optimize.pipeline import GateFailed, OptimizeOptions
    from surge.optimize.pipeline import optimize as run

    console = Console(stderr=True)
    # Over the budget the run would use anyway (pruning's LOSSY one included), not always the precision's.
    overrides = {k: v for k, v in (("mean_cosine", min_cosine), ("top1", min_top1), ("top1_strict", min_top1_strict),
                                     ("kappa", min_kappa), ("rank_top1", min_rank_top1), ("ndcg10", min_ndcg10),
                                     ("rank_tau", min_rank_tau), ("rank_score", min_rank_score))
                 if v is not None}
    alpha: float | str | None = {"auto": "auto", "off": None}.get(smooth_alpha.lower(), smooth_alpha)
    if isinstance(alpha, str) and alpha != "auto":
        try:
            alpha = float(alpha)
        except ValueError:
            pass  # OptimizeOptions.check names the bad value
    calibration = heldout = None
    if max_sentences > 0:
        from surge.data import calibration_queries, heldout_queries

        calibration, heldout = calibration_queries()[:max_sentences], heldout_queries()[:max_sentences]
    options = OptimizeOptions(budget_overrides=overrides, calibration=calibration, heldout=heldout, target=target, precision=precision, auto_block_list=auto_block_list,
                              block_list=list(block) if block else None, per_channel=per_channel, smooth_alpha=alpha, int8_fallback=int8_fallback, int8_method=int8_method, int8_outliers=int8_outliers,
                              prune_heads=prune_heads, rules=list(rule or []), force=force,
                              measure_latency=not no_latency, threads=threads, min_speedup=min_speedup)
    try:
        from surge.optimize.latency import parse_shapes

        options.serving_shapes = parse_shapes(shapes)
        spec = load_model_spec(model_dir or bundled_model_dir())
        _check_encoder(spec)
        with console.status("[bold]optimizing[/]") as status:
            def progress(step: str) -> None:
                status.update(f"[bold]{spec.name}[/]: {step}")
                if not console.is_terminal:
                    console.print(f"surge optimize: {step}")

            def on_pass(report) -> None:
                console.print(f"  [green]✓[/] {report.name:<18} {report.nodes_before:>5} → {report.nodes_after:<5} nodes")

            result = run(spec, output, options, cache_dir or default_cache_dir(), progress, on_pass)
    except GateFailed as exc:
        _report(console, exc.result.manifest, exc.result.reports, explain)
        console.print(f"[bold red]not written[/]: {exc.message} (use --force to write it anyway)")
        raise typer.Exit(code=2)
    except SurgeError as exc:
        console.print(f"[bold red]error[/]: {exc.message}", soft_wrap=True)  # a path stays whole, to copy
        raise typer.Exit(code=1)
    _report(console, result.manifest, result.reports, explain)
    note = " [yellow](forced past a failed gate)[/]" if result.manifest.get("forced") else ""
    console.print(f"[bold green]wrote[/] {result.artifact}{note}")


def _report(console, manifest: dict, reports, explain: bool) -> None:
    from surge.cli.optimize_report import render

    render(console, manifest, reports, explain)


def _check_encoder(spec) -> None:
    """The optimizer exports encoders to ONNX; a decoder (a generator, or an embedding model built on one)
    is served from its weights as it is."""
    from surge.errors import ConfigError
    from surge.models.decoder import SUPPORTED

    if spec.model_type in SUPPORTED:
        raise ConfigError(f"{spec.path.name} is a decoder ({spec.task_info.architecture}, task {spec.task}): "
                          "surge optimize exports encoder models to ONNX; serve this one as it is with "
                          "`surge serve DIR` (its engine loads the weights directly)")

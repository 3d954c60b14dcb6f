"""`surge distill MODEL -o DIR --layers K --ffn-size N`: train a shallower or narrower student, gate it, write a model directory.

The student is validated by the optimizer's gate (the held-out queries in
the serving layout, against the teacher's FP32 export) and by its latency
gate (faster than the teacher at the serving shapes). A student that misses
either is left in DIR.rejected with its report instead (--force promotes it).
The written directory is a Hugging Face model directory: `surge optimize`
and `surge serve` take it like any other.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from surge.config import default_cache_dir


def register(app: typer.Typer) -> None:
    app.command("distill")(distill)


def distill(
    model_dir: Optional[Path] = typer.Argument(None, help="Teacher: a Hugging Face model directory (default: the bundled all-MiniLM-L6-v2)."),
    output: Path = typer.Option(..., "-o", "--output", help="Student model directory to write."),
    layers: int = typer.Option(4, "--layers", help="Encoder layers the student keeps (the last always)."),
    ffn_size: int = typer.Option(0, "--ffn-size", help="FFN neurons per student layer (the teacher's most important, measured on training text; 0: the teacher's size). With --layers equal to the teacher's, a student as deep as its teacher but narrower."),
    precision: str = typer.Option("fp32", "--precision", help="Training arithmetic: fp32, or bf16 (CPU autocast; the weights and the written student stay FP32)."),
    layer_choice: str = typer.Option("measured", "--layer-choice", help="measured: the subset of teacher layers whose untrained student is closest to the teacher; spaced: evenly spaced."),
    steps: int = typer.Option(20000, "--steps", help="Training steps (at most: --time-budget may stop it first)."),
    time_budget: float = typer.Option(600.0, "--time-budget", help="Seconds of training at most (0: no limit); the learning-rate schedule follows steps or time, whichever is further along."),
    batch_size: int = typer.Option(32, "--batch-size", help="Sentences per training step."),
    lr: float = typer.Option(5e-4, "--lr", help="AdamW learning rate (cosine decay after a short warm-up)."),
    bank_weight: float = typer.Option(0.0, "--bank-weight", help="Weight of a ranking loss over a bank of the teacher's vectors of the training texts (0: off): each sentence's softmax over its cosines to 8,192 of them against the teacher's."),
    texts: Optional[Path] = typer.Option(None, "--texts", help="Training text: one per line or JSON lines with 'text' (a query log). Default: the shipped calibration queries + prose sentences + 20,000 variants of the queries + the shipped distillation text (assistant skills' utterances and replies, chit-chat; no held-out query)."),
    min_cosine: float = typer.Option(0.95, "--min-cosine", help="Gate: mean cosine to the teacher on the held-out queries."),
    min_top1: float = typer.Option(0.90, "--min-top1", help="Gate: retrieval top-1 agreement with the teacher (ties within 0.01 agree)."),
    max_sentences: int = typer.Option(0, "--max-sentences", help="Gate on the first N held-out queries only (0: all 2,715)."),
    no_latency: bool = typer.Option(False, "--no-latency", help="Skip the latency gate."),
    force: bool = typer.Option(False, "--force", help="Promote the student even if it misses a gate."),
    seed: int = typer.Option(0, "--seed", help="Seed for initial order and sampling."),
    threads: int = typer.Option(0, envvar="SURGE_THREADS", help="Torch / ONNX Runtime threads (0: all cores)."),
    device: str = typer.Option("cpu", "--device", help="Where the student trains: cpu, or cuda[:N] on a GPU machine (the gate runs on the CPU either way)."),
    cache_dir: Optional[Path] = typer.Option(None, envvar="SURGE_CACHE_DIR", help="Where FP32 exports are cached."),
) -> None:
    """Distil a model into a shallower (--layers) or narrower (--ffn-size) student trained to reproduce its outputs."""
    import json
    import shutil

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from surge.errors import SurgeError
    from surge.models import bundled_model_dir, load_model_spec
    from surge.optimize.distill import DistillOptions, check_teacher, plot_losses, read_texts
    from surge.optimize.distill import distill as train

    console = Console(stderr=True)
    output = Path(output)
    staging = output.with_name(output.name + ".staging")
    try:
        spec = load_model_spec(model_dir or bundled_model_dir())
        check_teacher(spec)
        options = DistillOptions(layers=layers, ffn_size=ffn_size, precision=precision, steps=steps, batch_size=batch_size, lr=lr, seed=seed, threads=threads,
                                 bank_weight=bank_weight, device=device,
                                 time_budget=time_budget, layer_choice=layer_choice,
                                 texts=read_texts(texts) if texts else None)
        options.check(spec.num_layers, spec.config.get("intermediate_size"))
        shape = _shape(spec, options)
        if staging.exists():
            shutil.rmtree(staging)
        with Progress(TextColumn("[bold]distilling[/] {task.description}"), BarColumn(),
                      TextColumn("step {task.fields[step]}"), TextColumn("loss {task.fields[loss]:.4f}"),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                      transient=not console.is_terminal) as bar:
            # Progress is steps or time, whichever is further along (--time-budget may end it first).
            task = bar.add_task(f"{spec.name}: {shape}", total=1000, loss=float("nan"),
                                step=0)
            said = [0]

            def on_step(step: int, loss: float, progress: float) -> None:
                bar.update(task, completed=int(1000 * progress), loss=loss, step=step + 1)
                if not console.is_terminal and int(10 * progress) > said[0]:
                    said[0] = int(10 * progress)
                    console.print(f"surge distill: {10 * said[0]}% (step {step + 1}) loss {loss:.4f}")  # logs get progress too

            result = train(spec, staging, options, on_step)
        report = result.to_json()
        plot_losses(result.losses, staging / "distill_loss.png", f"{spec.name}: {shape}")
        console.print(f"trained {len(result.losses)} steps in {result.seconds:.0f} s on {result.texts} texts; "
                      f"loss {report['loss_first_10pct']:.4f} -> {report['loss_last_10pct']:.4f}; "
                      f"kept teacher layers {result.kept_layers}, FFN size {result.info['student_ffn_size']}")
        report["gate"], report["latency"] = _gate(spec, staging, min_cosine, min_top1, max_sentences, threads,
                                                  not no_latency, cache_dir or default_cache_dir(), console)
        failures = list(report["gate"]["failures"])
        if report["latency"].get("gate") and not report["latency"]["gate"]["passed"]:
            failures.append("latency gate failed: the student is not faster than its teacher")
        report["promoted"], report["forced"] = not failures or force, bool(failures) and force
        (staging / "distill.json").write_text(json.dumps(report, indent=2, default=str))
        _render(console, report)
        target = output if (not failures or force) else output.with_name(output.name + ".rejected")
        if target.exists():
            if not (target / "config.json").is_file() and any(target.iterdir()):
                raise SurgeError(f"{target} exists and is not a model directory; refusing to overwrite it")
            shutil.rmtree(target)
        staging.rename(target)
    except SurgeError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        console.print(f"[bold red]error[/]: {exc.message}", soft_wrap=True)  # a path stays whole, to copy
        raise typer.Exit(code=1)
    except BaseException:  # a crash (or Ctrl-C) leaves no half-made student beside the output
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if failures and not force:
        console.print(f"[bold red]not promoted[/]: {'; '.join(failures)} (the student is in {target}; --force promotes it)")
        raise typer.Exit(code=2)
    note = " [yellow](forced past a failed gate)[/]" if failures else ""
    console.print(f"[bold green]wrote[/] {target} (loss curve: {target / 'distill_loss.png'}){note}")


def _shape(spec, options) -> str:
    """'6 -> 4 layers', '6 layers, FFN 1536 -> 768', or both."""
    ffn = spec.config.get("intermediate_size")
    parts = [] if options.layers == spec.num_layers else [f"{spec.num_layers} -> {options.layers} layers"]
    if options.ffn_size and options.ffn_size != ffn:
        parts.append(f"{'' if parts else f'{spec.num_layers} layers, '}FFN {ffn} -> {options.ffn_size}")
    return ", ".join(parts)


def _gate(spec, student_dir: Path, min_cosine: float, min_top1: float, max_sentences: int, threads: int,
          latency: bool, cache_dir: Path, console) -> tuple[dict, dict]:
    from surge.data import calibration_queries, heldout_queries
    from surge.models import load_model_spec
    from surge.optimize.export import ensure_exported
    from surge.optimize.validate import Budget, Evaluator

    with console.status("[bold]gate[/]: exporting teacher and student, measuring on the held-out queries"):
        student = load_model_spec(student_dir, name=spec.name)
        teacher_onnx = ensure_exported(spec, cache_dir) / "model.onnx"
        student_onnx = ensure_exported(student, cache_dir) / "model.onnx"
        heldout = heldout_queries()[:max_sentences] if max_sentences > 0 else heldout_queries()
        # Calibration text is training text here: the gate that counts is the held-out set.
        calibration = calibration_queries()[: min(200, len(heldout))]
        evaluator = Evaluator(spec, teacher_onnx, calibration, heldout, threads=threads)
        evaluator.head = None  # the student's head was trained too: the teacher's head would not read its states
        # A classifier's or reranker's graph returns logits, where the gate skips the embedding floors
        # (validate.check): without its task's floors such a student would pass whatever it predicts.
        # kappa: what the label floor means with two balanced labels (kappa = 2 p - 1), so that a student
        # answering the commonest label everywhere (kappa 0) is refused however common that label is.
        budget = Budget(mean_cosine=min_cosine, top1=min_top1, argmax=min_top1, rank_top1=min_top1, ndcg10=min_cosine,
                        kappa=max(0.0, 2 * min_top1 - 1))
        gate = evaluator.gate(student_onnx.read_bytes(), budget)
        lat: dict = {"measured": False, "why": "--no-latency"}
        if latency:
            from surge.optimize.latency import compare_latency

            lat = compare_latency(teacher_onnx, student_onnx, spec, threads)
    return gate.to_json(), lat


def _render(console, report: dict) -> None:
    from rich.table import Table

    acc = Table(title="student vs teacher (FP32, ONNX Runtime)")
    sets = report["gate"]["sets"]
    # a task model's sets have no retrieval top-1 (None) but its task's metric
    task_cols = [k for k in ("argmax", "kappa", "rank_top1", "ndcg10", "rank_tau", "rank_score")
                 if any(m.get(k) is not None for m in sets.values())]
    for col in ("set", "n", "mean cos", "worst 1% cos", "min cos", "top-1 strict [95% CI]", "top-1 (ties) [95% CI]",
                *task_cols):
        acc.add_column(col, justify="right")

    def rate(v, ci) -> str:
        return "-" if v is None else f"{v:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")

    for name, m in sets.items():
        acc.add_row(name, str(m["n"]), f"{m['mean_cosine']:.4f}", f"{m['tail_cosine']:.4f}", f"{m['min_cosine']:.4f}",
                    rate(m["top1"], m.get("top1_ci95")), rate(m["top1_tie"], m.get("top1_tie_ci95")),
                    *[rate(m.get(k), None) for k in task_cols])
    console.print(acc)
    verdict = "[green]passed[/]" if report["gate"]["passed"] else "[red]FAILED: " + "; ".join(report["gate"]["failures"]) + "[/]"
    console.print(f"accuracy gate: {verdict}")
    lat = report.get("latency") or {}
    if lat.get("measured"):
        t = Table(title="latency, ONNX Runtime CPU (median ms, interleaved rounds)")
        for col in ("batch", "seq", "teacher", "student", "speedup", "faster?"):
            t.add_column(col, justify="right")
        for r in lat["rows"]:
            t.add_row(str(r["batch"]), str(r["seq"]), f"{r['source_ms']:.2f}", f"{r['optimized_ms']:.2f}",
                      f"{r['speedup']:.2f}x", "yes" if r["faster"] else "no")
        console.print(t)

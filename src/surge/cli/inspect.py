"""`surge inspect ...`: look inside a model without serving it.

    surge inspect memory MODEL --batch 64 --seq 512 [--precision fp16] [--weight-budget-mb 200]
"""

from __future__ import annotations

from pathlib import Path

import typer

inspect_app = typer.Typer(help="Look inside a model: memory plan.", no_args_is_help=True)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


@inspect_app.command("memory")
def memory(
    model: str = typer.Argument("bundled", help="A Hugging Face model directory, or 'bundled'."),
    batch: int = typer.Option(64, min=1, help="Sequences per batch."),
    seq: int = typer.Option(512, min=1, help="Tokens per sequence."),
    precision: str = typer.Option("fp16", help="fp32, fp16 or bf16."),
    weight_budget_mb: float = typer.Option(None, help="GPU memory for weights; layers beyond it stream from host."),
) -> None:
    """Print the GPU engine's memory plan: peak, naive sum and the breakdown."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from surge.engines.encoder_weights import read_config
    from surge.engines.memory import memory_report, plan_workspace
    from surge.errors import SurgeError

    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    console = Console()
    if precision not in dtypes:
        console.print(f"[red]precision must be one of {', '.join(dtypes)}[/red]")
        raise typer.Exit(2)
    try:
        if model == "bundled":
            from surge.models import bundled_model_dir

            path = bundled_model_dir()
        else:
            path = Path(model)
        cfg = read_config(path)
        budget = None if weight_budget_mb is None else int(weight_budget_mb * 2**20)
        rep = memory_report(cfg, batch, seq, dtypes[precision], budget)
    except SurgeError as exc:
        console.print(f"[red]{exc.message}[/red]")
        raise typer.Exit(1) from None
    plan = plan_workspace(cfg, batch * seq, batch, dtypes[precision])
    t = Table(title=f"{path.name}: {cfg.model_type}, {cfg.layers} layers, hidden {cfg.hidden}, "
                    f"batch {batch} x seq {seq}, {precision}")
    t.add_column("part")
    t.add_column("bytes", justify="right")
    t.add_column("what")
    t.add_row("context", _mib(rep["context"]), "CUDA context and kernels (estimate; not surge's allocation)")
    t.add_row("weights", _mib(rep["weights"]), "on the GPU" + (f" (of {_mib(rep['weights_total'])}; the rest "
                                                                "in pinned host memory)" if budget else ""))
    t.add_row("workspace", _mib(rep["workspace"]), "every activation of every layer, lifetimes overlapped")
    for r in plan.regions:
        t.add_row(f"  {r.name}", _mib(r.nbytes), f"{list(r.shape)} {str(r.dtype).replace('torch.', '')}")
    t.add_row("I/O (device)", _mib(rep["io_device"]), "token ids, types, positions, cu_seqlens (in the workspace)")
    t.add_row("I/O (host, pinned)", _mib(rep["io_host_pinned"]), "staging for the H2D and D2H copies")
    t.add_row("libraries", _mib(rep["libraries"]), "cuBLAS workspace of the engine's stream")
    t.add_row("[bold]peak[/bold]", f"[bold]{_mib(rep['peak'])}[/bold]", "context + weights + workspace + libraries")
    t.add_row("naive sum", _mib(rep["naive_peak"]),
              f"every activation in its own buffer: {_mib(rep['naive_activations'])} of activations")
    console.print(t)


def register(app: typer.Typer) -> None:
    app.add_typer(inspect_app, name="inspect")

"""The `surge` command: one module per subcommand."""

from __future__ import annotations

import typer

app = typer.Typer(name="surge", help="Fast, cheap serving of transformer NLP models.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_show_locals=False)


@app.callback()
def _main() -> None:
    """Fast, cheap serving of transformer NLP models."""


def _register() -> None:
    from surge.cli import serve

    serve.register(app)
    for name in ("optimize", "bench", "inspect", "distill"):
        try:
            module = __import__(f"surge.cli.{name}", fromlist=["register"])
        except ImportError:
            continue
        module.register(app)


_register()

if __name__ == "__main__":
    app()

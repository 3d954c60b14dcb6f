"""`python -m surge ...`: the `surge` command, for where its entry point is not on PATH (or is another
install's)."""

from surge.cli.main import app

if __name__ == "__main__":
    app(prog_name="surge")

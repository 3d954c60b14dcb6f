"""Shared fixtures: the bundled model, its exported artifact, the PyTorch reference."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
# Exports are reused between test runs (and by server processes the tests start).
CACHE_DIR = Path(os.environ.get("SURGE_TEST_CACHE_DIR", ROOT / ".pytest_cache" / "surge"))
os.environ.setdefault("SURGE_CACHE_DIR", str(CACHE_DIR))


# Files whose tests keep both cores busy for tens of seconds (INT8 search, distillation, the CPU encoder): in
# scripts/test.sh's two pytest-xdist workers they run in one worker, one at a time, so that two of them never
# share the two cores (each would run at under half speed, its threads waiting for the other's); every other
# file is its own unit, as with --dist loadfile.
CPU_HEAVY = {"tests/integration/test_task_fallback.py", "tests/integration/test_int8_heldout.py",
             "tests/integration/test_optimize.py", "tests/integration/test_optimize_tasks.py",
             "tests/unit/optimize/test_distill_width.py", "tests/unit/optimize/test_rowquant.py",
             "tests/unit/optimize/test_int8_options.py", "tests/unit/test_encoder_cpu.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group("cpu-heavy" if path in CPU_HEAVY else path))
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

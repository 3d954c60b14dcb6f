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


# The slowest files, seconds measured on CI's 2 cores (a clean clone's run in two workers, 2026-12-04: each
# file's tests summed from pytest's junit report). scripts/test.sh's pytest-xdist workers take whole files in collection order; these go first,
# longest first, so that no long file starts last and runs alone at the end (xdist's own order, by the number of
# tests in a file, put them there: a few long tests each).
SLOW_FILES = {"tests/integration/test_int8_heldout.py": 204, "tests/integration/test_task_fallback.py": 198,
              "tests/unit/optimize/test_distill_width.py": 161, "tests/e2e/test_ray_serve.py": 149,
              "tests/unit/optimize/test_rowquant.py": 141, "tests/e2e/test_openapi_fuzz.py": 122,
              "tests/integration/test_optimize_tasks.py": 101, "tests/e2e/test_workers_repository.py": 93,
              "tests/unit/test_encoder_cpu.py": 92, "tests/integration/test_optimize.py": 90,
              "tests/integration/test_task_heads.py": 82, "tests/e2e/test_runtime_serving.py": 68,
              "tests/e2e/test_ray_generate.py": 57, "tests/e2e/test_bench.py": 57}


def pytest_collection_modifyitems(config, items):
    # stable: within a file, and among the other files, pytest's own order
    items.sort(key=lambda item: -SLOW_FILES.get(item.nodeid.split("::")[0], 0))
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

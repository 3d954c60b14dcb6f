"""Fixtures of the CUDA tests: the bundled MiniLM and its FP32 reference vectors.

On a GPU machine without the bundled-model package, SURGE_GPU_MODEL_DIR points
at a copy of the model (weights may be stored in fp16) and SURGE_GPU_REF at the
FP32 reference vectors of all `load_sentences()` computed from the original
fp32 weights (benchmarks/gpu_prepare.py writes both).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def model_dir() -> Path:
    env = os.environ.get("SURGE_GPU_MODEL_DIR")
    if env:
        return Path(env)
    from surge.models import bundled_model_dir

    return bundled_model_dir()


@pytest.fixture(scope="session")
def reference(model_dir, sentences):
    env = os.environ.get("SURGE_GPU_REF")
    if env:
        return np.load(env)
    from surge.models import load_model_spec
    from tests.reference import TorchReference

    return TorchReference(load_model_spec(model_dir))(sentences)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from surge.models import load_model_spec
    from surge.runtime.tokenize import Tokenizer

    spec = load_model_spec(model_dir)
    return Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)

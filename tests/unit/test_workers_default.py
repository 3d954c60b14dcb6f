"""`--workers` by default: multi-process where the mode supports it (one embedding model, torch
engine, one CUDA device, cores to spare), one process otherwise; explicit values win."""

from __future__ import annotations

import pytest

from surge.cli import workers as W
from surge.config import EngineConfig, ServerConfig


@pytest.mark.parametrize("cores, kw, want", [
    (16, dict(engine=EngineConfig(engine="torch", device="cuda")), 12),
    (64, dict(engine=EngineConfig(engine="torch", device="cuda:1")), 12),
    (8, dict(engine=EngineConfig(engine="torch", device="cuda")), 6),
    (2, dict(engine=EngineConfig(engine="torch", device="cuda")), 1),  # no cores to spare
    (16, dict(), 1),  # CPU engines: the engine is the limit, one process
    (16, dict(engine=EngineConfig(engine="torch", device="cuda", devices=[0, 1])), 1),  # replicas
    (16, dict(engine=EngineConfig(engine="torch", device="cuda"), task="classify"), 1),  # task heads
    (16, dict(engine=EngineConfig(engine="torch", device="cuda"), workers=1), 1),  # explicit
    (16, dict(workers=3), 3),
    (16, dict(workers=0), 16),  # one per core
])
def test_default_workers_from_the_core_count_where_the_mode_supports_it(monkeypatch, cores, kw, want):
    monkeypatch.setattr(W.os, "cpu_count", lambda: cores)
    config = ServerConfig(**kw)
    assert W.resolve_workers(config) == want
    assert W.engine_processes(config, want) == (2 if want >= 8 else 1)
    assert W.engine_processes(ServerConfig(**kw, engine_processes=3), want) == 3


def test_a_repository_defaults_to_one_process_and_takes_engine_processes_as_one_model_does(monkeypatch, tmp_path):
    monkeypatch.setattr(W.os, "cpu_count", lambda: 16)
    cuda = EngineConfig(engine="torch", device="cuda")
    assert W.resolve_workers(ServerConfig(model_repository=tmp_path, engine=cuda)) == 1
    config = ServerConfig(model_repository=tmp_path, engine=cuda, workers=12)
    assert W.resolve_workers(config) == 12 and W.engine_processes(config, 12) == 2
    assert W.engine_processes(ServerConfig(model_repository=tmp_path, workers=2), 2) == 1
    assert W.engine_processes(ServerConfig(model_repository=tmp_path, workers=2, engine_processes=2), 2) == 2

"""optimize/artifact.staging_dir: "a crash halfway never leaves a half-written artifact ...; two processes
racing both succeed" (its docstring), checked with real processes and at the race's narrowest point."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from surge.optimize import artifact as art


def _build(final: Path, tag: str) -> None:
    with art.staging_dir(final) as tmp:
        (tmp / art.MODEL_FILE).write_text(tag)
        (tmp / art.MANIFEST).write_text("{}")


def _racer(root: str, tag: str, start, n: int) -> None:
    start.wait()
    for i in range(n):
        _build(Path(root) / f"a{i}", tag)


def test_two_processes_building_the_same_artifacts_both_succeed(tmp_path):
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_racer, args=(str(tmp_path), tag, start, 60)) for tag in ("x", "y")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    for i in range(60):
        final = tmp_path / f"a{i}"
        assert art.is_complete(final) and (final / art.MODEL_FILE).read_text() in ("x", "y")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"a{i}" for i in range(60))  # no staging left


def test_a_copy_renamed_in_between_the_check_and_the_rename_is_kept(tmp_path, monkeypatch):
    final = tmp_path / "a"
    real = os.replace

    def other_process_first(src, dst):  # the other builder wins the window after the exists() check
        _build_plain(Path(dst), "other")
        real(src, dst)

    monkeypatch.setattr(art.os, "replace", other_process_first)
    _build(final, "mine")
    assert (final / art.MODEL_FILE).read_text() == "other" and art.is_complete(final)
    assert [p.name for p in tmp_path.iterdir()] == ["a"]


def _build_plain(final: Path, tag: str) -> None:
    final.mkdir()
    (final / art.MODEL_FILE).write_text(tag)
    (final / art.MANIFEST).write_text("{}")


def test_a_failed_build_leaves_nothing(tmp_path):
    final = tmp_path / "a"
    with pytest.raises(RuntimeError):
        with art.staging_dir(final) as tmp:
            (tmp / art.MODEL_FILE).write_text("half")
            raise RuntimeError("crash halfway")
    assert not final.exists() and list(tmp_path.iterdir()) == []

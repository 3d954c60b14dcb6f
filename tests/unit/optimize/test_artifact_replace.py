"""Re-running `surge optimize` over an existing artifact replaces it only once the new one is whole: a run
that fails while writing leaves the old artifact as it was (a server may be reading it), and a run that
succeeds leaves the new artifact alone in its place, no staging or backup folders beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from surge.models import bundled_model_dir, load_model_spec
from surge.optimize import artifact as art
from surge.optimize.pipeline import _write


def _old_artifact(path: Path) -> dict[str, bytes]:
    path.mkdir(parents=True)
    files = {art.MANIFEST: b'{"format": 1, "note": "the old one"}', art.MODEL_FILE: b"old model bytes",
             "tokenizer.json": b"{}"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return files


def _contents(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


def test_a_write_that_fails_leaves_the_old_artifact_whole(tmp_path):
    out = tmp_path / "artifact"
    old = _old_artifact(out)
    spec = load_model_spec(bundled_model_dir())
    with pytest.raises(Exception):
        _write(out, None, {"format": 1}, spec)  # onnx.save of no model raises mid-write
    assert _contents(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]  # no staging folder left behind


def test_staging_dir_replace_swaps_in_the_new_artifact_and_leaves_nothing_beside_it(tmp_path):
    out = tmp_path / "artifact"
    _old_artifact(out)
    with art.staging_dir(out, replace=True) as tmp:
        (tmp / art.MANIFEST).write_bytes(b'{"format": 1, "note": "the new one"}')
        (tmp / art.MODEL_FILE).write_bytes(b"new model bytes")
    assert _contents(out) == {art.MANIFEST: b'{"format": 1, "note": "the new one"}',
                              art.MODEL_FILE: b"new model bytes"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]


def test_staging_dir_without_replace_keeps_a_complete_artifact_another_process_wrote(tmp_path):
    out = tmp_path / "artifact"
    old = _old_artifact(out)
    with art.staging_dir(out) as tmp:
        (tmp / art.MANIFEST).write_bytes(b"{}")
        (tmp / art.MODEL_FILE).write_bytes(b"x")
    assert _contents(out) == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]

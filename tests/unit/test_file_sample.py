"""runtime/file_sample.update_sampled: what a model file's sampled digest sees and what it does not."""

from __future__ import annotations

import hashlib
import os

from surge.runtime.file_sample import CHUNK, update_sampled


def _digest(d, names, samples=1):
    h = hashlib.sha256()
    update_sampled(h, d, names, samples)
    return h.hexdigest()


def test_the_sampled_points_and_only_those_change_the_digest(tmp_path):
    """samples=1 reads the head and the tail: a byte changed there changes the digest, one in the middle does not;
    samples=16 reads 17 points spread evenly, so the middle byte shows too. The size and the name always count;
    names that are not files are skipped."""
    blob = bytearray(os.urandom(40 * CHUNK))
    (tmp_path / "w.bin").write_bytes(blob)
    base = {s: _digest(tmp_path, ["w.bin", "missing.json"], s) for s in (1, 16)}
    assert base[1] == _digest(tmp_path, ["w.bin"], 1), "a name that is not a file is skipped"

    def changed(at, samples):
        b = bytearray(blob)
        b[at] ^= 0xFF
        (tmp_path / "w.bin").write_bytes(b)
        try:
            return _digest(tmp_path, ["w.bin"], samples) != base[samples]
        finally:
            (tmp_path / "w.bin").write_bytes(blob)

    assert changed(10, 1) and changed(len(blob) - 10, 1)
    assert not changed(len(blob) // 2 - CHUNK // 2 - 1, 1)  # between the head and the tail: unseen at 1 sample
    assert changed(len(blob) // 2, 16)
    (tmp_path / "w.bin").write_bytes(bytes(blob) + b"x")
    assert _digest(tmp_path, ["w.bin"], 1) != base[1], "the size counts"
    (tmp_path / "w.bin").write_bytes(blob)
    (tmp_path / "v.bin").write_bytes(blob)
    assert _digest(tmp_path, ["v.bin"], 1) != base[1], "the name counts"

"""A cheap digest of model files that is the same in every process: each file's name and size and chunks sampled
across it, not the whole file hashed (a model's weights are gigabytes; a build is keyed at every load)."""

from __future__ import annotations

from pathlib import Path

CHUNK = 1 << 16


def update_sampled(digest, directory: Path, names, samples: int = 1) -> None:
    """Feed `digest` (a hashlib object) each of `names` that is a file in `directory`, in the order given: its
    name and size, then samples + 1 chunks of CHUNK bytes spread evenly from its start to its end (samples=1:
    the head and the tail; more: a change inside the file, a fine-tune of middle layers, shows too)."""
    for name in names:
        path = Path(directory) / name
        try:
            size = path.stat().st_size
            with path.open("rb") as fh:
                digest.update(f"{name}:{size}".encode())
                for i in range(samples + 1):
                    fh.seek(max(0, size - CHUNK) * i // samples)
                    digest.update(fh.read(CHUNK))
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue

"""Artifacts: a directory of model files plus `manifest.json`, and the cache of them.

An exported artifact is keyed by a hash of the model files and the export
settings, so a second start with the same model reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"


def settings_key(model_hash: str, settings: dict) -> str:
    blob = json.dumps({"model": model_hash, "settings": settings}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def read_manifest(artifact: Path) -> dict:
    return json.loads((Path(artifact) / MANIFEST).read_text())


def write_manifest(artifact: Path, manifest: dict) -> None:
    manifest = dict(manifest)
    manifest.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (Path(artifact) / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))


def is_complete(artifact: Path) -> bool:
    return (artifact / MANIFEST).is_file() and (artifact / MODEL_FILE).is_file()


class staging_dir:
    """Build an artifact in a temporary sibling, then rename it into place.

    A crash halfway never leaves a half-written artifact that a later start
    would take for a good one; two processes racing both succeed. A complete
    artifact already in place is kept (another process wrote the same one),
    unless `replace`: then it is swapped out only once the new one is whole,
    so a failed re-run leaves the old artifact as it was.
    """

    def __init__(self, final: Path, replace: bool = False):
        self.final = Path(final)
        self.replace = replace

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.", dir=self.final.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.replace and self.final.exists():
            self._swap()
            return
        if self.final.exists():
            if is_complete(self.final):
                shutil.rmtree(self.tmp, ignore_errors=True)
                return
            shutil.rmtree(self.final, ignore_errors=True)
        try:
            os.replace(self.tmp, self.final)
        except OSError:  # another process renamed its copy into place since the check (not empty: ENOTEMPTY)
            if not is_complete(self.final):
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _swap(self) -> None:
        # two renames, not an rmtree first: between them the old artifact still exists under its backup
        # name, and a failed second rename puts it back
        old = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.old.", dir=self.final.parent))
        os.replace(self.final, old / "artifact")
        try:
            os.replace(self.tmp, self.final)
        except OSError:
            os.replace(old / "artifact", self.final)
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(old, ignore_errors=True)

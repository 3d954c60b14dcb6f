"""Where a model repository's entries come from: versions on disk, each with its
validated model.yaml (or config.pbtxt), or the error that keeps it from loading.

`DiskCatalog` lists `<root>/<name>/<version>/`; cli/single_model.py has the catalog of
`surge serve MODEL` (one entry). ModelRepository (runtime/repository.py) reads either.
Names come from clients, so a name is only ever looked up in the catalog's own
listing, never joined onto a path.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from surge.config import ModelFile, load_yaml_file
from surge.errors import ConfigError, NotFound, relative_paths, shown

MODEL_YAML = "model.yaml"
PIPELINE_YAML = "pipeline.yaml"
CONFIG_PBTXT = "config.pbtxt"


@dataclass
class VersionEntry:
    """One version directory on disk, with its validated model.yaml (or the error)."""

    name: str
    version: str
    dir: Path
    config: ModelFile | None = None
    error: str | None = None
    fingerprint: str = ""

    def resolve(self, value: str | None) -> Path | None:
        """A path from model.yaml, relative to the version directory."""
        if value is None or value == "bundled":
            return None
        path = Path(value).expanduser()
        return path if path.is_absolute() else (self.dir / path).resolve()

    @property
    def source_dir(self) -> Path | None:
        """The model directory; None means the bundled model."""
        return self.resolve(self.config.source) if self.config else None

    @property
    def artifact_dir(self) -> Path | None:
        return self.resolve(self.config.artifact) if self.config and self.config.artifact else None

    @property
    def speculative_model_dir(self) -> Path | None:
        """The generation section's draft model (speculative_model), as `source` is resolved."""
        gen = self.config.generation if self.config else None
        return self.resolve(gen.speculative_model) if gen is not None and gen.speculative_model else None


@dataclass
class ModelEntry:
    name: str
    versions: dict[str, VersionEntry] = field(default_factory=dict)
    error: str | None = None  # a problem with the model as a whole (no versions, bad shared yaml)

    def sorted_versions(self) -> list[str]:
        return sorted(self.versions, key=int)

    def valid_versions(self) -> list[str]:
        return [v for v in self.sorted_versions() if self.versions[v].config is not None]

    def desired(self) -> list[str]:
        valid = self.valid_versions()
        if not valid:
            return []
        policy = self.versions[valid[-1]].config.version_policy
        return policy.select(valid)


def inside(path: Path, root: Path) -> bool:
    """Whether `path`, symlinks followed, lies in `root` (a resolved directory)."""
    try:
        return Path(path).resolve().is_relative_to(root)
    except (OSError, ValueError):
        return False


def scan_model(root: Path, name: str) -> ModelEntry:
    """Read `<root>/<name>/`: shared model.yaml, then each numeric version directory."""
    root = Path(root).resolve()
    entry = _scan_model(root, name)
    entry.error = relative_paths(entry.error, root) if entry.error else entry.error
    for ventry in entry.versions.values():
        ventry.error = relative_paths(ventry.error, root) if ventry.error else ventry.error
    return entry


def _scan_model(root: Path, name: str) -> ModelEntry:
    model_dir = root / name
    entry = ModelEntry(name)
    shared: dict = {}
    shared_file = model_dir / MODEL_YAML
    if shared_file.is_file():
        try:
            load_yaml_file(shared_file, ModelFile)  # validate on its own first: errors name this file
            shared = yaml.safe_load(shared_file.read_text(encoding="utf-8")) or {}
        except ConfigError as exc:
            entry.error = exc.message
            return entry
    # ASCII digits only: "²".isdigit() holds, but int("²") raises (the whole model's scan with it).
    for sub in sorted(p for p in model_dir.iterdir() if p.is_dir() and p.name.isascii() and p.name.isdigit()):
        ventry = VersionEntry(name, str(int(sub.name)), sub)
        own = sub / MODEL_YAML
        # Triton's config.pbtxt (in the version directory, or the model's) stands in for a model.yaml.
        pbtxt = next((p for p in (sub / CONFIG_PBTXT, model_dir / CONFIG_PBTXT) if p.is_file()), None)
        texts = [shared_file.read_bytes() if shared_file.is_file() else b""]
        try:
            if not inside(sub, root):
                raise ConfigError(f"{sub}: the version directory lies outside the repository")
            if own.is_file():
                texts.append(own.read_bytes())
                ventry.config = load_yaml_file(own, ModelFile, merge_with=shared)
            elif pbtxt is not None:
                from surge.models.config_pbtxt import load_model_file

                texts.append(pbtxt.read_bytes())
                ventry.config = load_model_file(pbtxt, merge_with=shared)
            elif shared_file.is_file():
                ventry.config = ModelFile.model_validate(shared)
            else:
                raise ConfigError(f"{own}: file missing (each version needs a model.yaml or a config.pbtxt, "
                                  f"or put one in {model_dir})")
            # Paths are named as model.yaml writes them: an absolute one outside the root is not echoed.
            for field_name, path in (("source", ventry.source_dir), ("artifact", ventry.artifact_dir)):
                if path is not None and not path.is_dir():
                    raise ConfigError(f"{own}: field '{field_name}': directory "
                                      f"'{getattr(ventry.config, field_name)}' does not exist", param=field_name)
            draft = ventry.speculative_model_dir
            if draft is not None and not draft.is_dir():
                raise ConfigError(f"{own}: field 'generation.speculative_model': directory "
                                  f"'{ventry.config.generation.speculative_model}' does not exist",
                                  param="generation.speculative_model")
            if ventry.artifact_dir is not None and not inside(ventry.artifact_dir, root):
                # Only `source` (model weights) may live elsewhere; what the server loads
                # as built for it stays inside the repository.
                raise ConfigError(f"{own}: field 'artifact': directory '{ventry.config.artifact}' lies outside "
                                  "the repository", param="artifact")
        except ConfigError as exc:
            ventry.config, ventry.error = None, exc.message
        ventry.fingerprint = hashlib.sha256(b"\0".join(texts)).hexdigest()[:16]
        entry.versions[ventry.version] = ventry
    if not entry.versions and entry.error is None:
        entry.error = f"{model_dir}: no version directories (expected {model_dir}/1/{MODEL_YAML})"
    return entry


class DiskCatalog:
    """The entries of a repository directory: `<root>/<name>/<version>/model.yaml`."""

    def __init__(self, root: Path):
        self.root = Path(root).expanduser().resolve()

    def names(self) -> list[str]:
        if not self.root.is_dir():
            raise ConfigError(f"model repository {self.root} does not exist")
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith((".", "_")) and not (p / PIPELINE_YAML).is_file()
                      and inside(p, self.root))

    def pipelines(self) -> dict[str, Path]:
        return {p.parent.name: p for p in sorted(self.root.glob(f"*/{PIPELINE_YAML}"))
                if not p.parent.name.startswith((".", "_")) and inside(p, self.root)}

    def scan(self, name: str) -> ModelEntry:
        names = self.names()
        if name not in names:  # an exact listed name: never a path built from what the client sent
            known = ", ".join(names) or "none"
            raise NotFound(f"model '{shown(name)}' is not in the repository; available: {shown(known, 512)}",
                           param="model")
        return scan_model(self.root, name)

    def read(self, name: str) -> ModelEntry:
        """A listed name's entry, unchecked (the index and polling read every listed name)."""
        return scan_model(self.root, name)

    def relative(self, message: str) -> str:
        return relative_paths(message, self.root)

"""`surge serve MODEL`: a model repository with one entry, version "1".

Single-model serving is repository serving over this catalog: the same
ModelRepository loads, warms up, reloads (new copy routed before the old one is
drained, so a reload drops nothing), unloads and, on SIGTERM, drains and frees
the model, and answers the KServe repository index. The entry is built from the
ServerConfig: MODEL is a Hugging Face (or decoder) directory, an artifact from
`surge optimize`, or a tensor model file (.onnx, .pt2, model.py). A model.yaml
(or config.pbtxt) beside a tensor file, or inside a model directory, is read as
the entry's model.yaml; flags and SURGE_* variables that are set override its
fields (cli/bootstrap.py merges them).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from surge.config import ModelFile, ServerConfig, load_yaml_file
from surge.errors import ConfigError, NotFound, shown
from surge.models import bundled_model_dir
from surge.runtime.catalog import CONFIG_PBTXT, MODEL_YAML, ModelEntry, VersionEntry

VERSION = "1"


class SingleModelCatalog:
    """The catalog of one model (ModelRepository's `source`)."""

    root = None  # no repository directory: no pipelines, paths named as given

    def __init__(self, config: ServerConfig):
        self.config = config
        path = Path(config.model_dir or bundled_model_dir()).expanduser()
        self.path = path.resolve() if path.exists() else path
        self.kind = _tensor_kind(self.path)
        self.name = config.model_name or _default_name(self.path, self.kind)

    def names(self) -> list[str]:
        return [self.name]

    def pipelines(self) -> dict[str, Path]:
        return {}

    def relative(self, message: str) -> str:
        return message

    def scan(self, name: str) -> ModelEntry:
        if name != self.name:
            raise NotFound(f"model '{shown(name)}' not found; this server serves '{self.name}'", param="model")
        return self.read(name)

    def read(self, name: str) -> ModelEntry:
        folder = self.path.parent if self.kind else self.path
        entry = VersionEntry(self.name, VERSION, folder)
        try:
            entry.config = self._model_file(folder)
        except ConfigError as exc:
            entry.error = exc.message
        entry.fingerprint = hashlib.sha256(
            (entry.config.model_dump_json() if entry.config else entry.error or "").encode()).hexdigest()[:16]
        return ModelEntry(self.name, {VERSION: entry})

    def _model_file(self, folder: Path) -> ModelFile:
        beside = next((p for p in (folder / MODEL_YAML, folder / CONFIG_PBTXT) if p.is_file()), None)
        if self.kind is None and beside is not None and beside.name != MODEL_YAML:
            beside = None  # a config.pbtxt describes tensor models only
        if beside is None:
            own = ModelFile()
        elif beside.suffix == ".yaml":
            own = load_yaml_file(beside, ModelFile)
        else:
            from surge.models.config_pbtxt import load_model_file

            own = load_model_file(beside)
        update: dict = {"aliases": list(dict.fromkeys([*own.aliases, *self.config.served_model_names]))}
        if self.kind is not None:  # the file named on the command line is the model
            update["kind"] = self.kind
            update["tensor"] = own.tensor.model_copy(update={"file": self.path.name})
        elif self.config.model_dir is None:
            update["source"] = "bundled"
        elif "source" not in own.model_fields_set:
            update["source"] = str(self.path)  # the directory itself (its model.yaml may point elsewhere)
        if self.config.task is not None:
            update["task"] = self.config.task
        # Validated again, so that fields_set keeps what the model.yaml set (bootstrap merges on it).
        data = own.model_dump(exclude_unset=True)
        data.update({k: (v.model_dump(exclude_unset=True) if hasattr(v, "model_dump") else v)
                     for k, v in update.items()})
        return ModelFile.model_validate(data)


def _tensor_kind(path: Path) -> str | None:
    from surge.runtime.tensor_loader import kind_of_path

    return kind_of_path(path)


def _default_name(path: Path, kind: str | None) -> str:
    if kind is None:
        from surge.models.hf import _default_name as hf_name

        return hf_name(path)
    folder = path.parent.parent if path.parent.name.isdigit() else path.parent  # <name>/<version>/model.onnx
    return folder.name if path.stem == "model" else path.stem

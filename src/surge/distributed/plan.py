"""What to deploy: the model versions to serve, each with its replica spec and
its Ray deployment config (defaults < model.yaml `ray:` section < CLI flags).

Exporting artifacts is the offline side's job, so the caller passes `resolve`
(the CLI passes cli.bootstrap.resolve_artifact); the driver exports each model
once and replicas only load the artifact.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml
from pydantic import ValidationError

from surge.config import BatchingConfig, CacheConfig, EngineConfig, GenerationConfig, ServerConfig
from surge.distributed.config import RayDeploymentConfig
from surge.distributed.replica import ReplicaSpec
from surge.errors import ConfigError
from surge.models import bundled_model_dir, load_model_spec
from surge.models.decoder import is_decoder_dir
from surge.models.hf import ModelSpec

Resolve = Callable[[ModelSpec, EngineConfig, "Path | None"], "Path | None"]


@dataclass
class DeploymentTarget:
    """One model version to deploy, and how."""

    spec: ReplicaSpec
    ray: RayDeploymentConfig

    @property
    def deployment_name(self) -> str:
        import re

        return "model-" + re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.spec.name}-v{self.spec.version}")


def ray_config(section: dict | RayDeploymentConfig | None, overrides: dict | None, where: str = "flags") -> RayDeploymentConfig:
    try:
        if isinstance(section, RayDeploymentConfig):
            base = section
        else:
            base = RayDeploymentConfig.model_validate(section or {})
        return base.merged(overrides)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ())) or "ray"
        raise ConfigError(f"{where}: ray.{field}: {err.get('msg', 'invalid').removeprefix('Value error, ')}",
                          param=f"ray.{field}") from None


def plan_single(config: ServerConfig, ray_cfg: RayDeploymentConfig, resolve: Resolve) -> list[DeploymentTarget]:
    """The one model of `config.model_dir` (default: the bundled model)."""
    spec = load_model_spec(config.model_dir or bundled_model_dir(), name=config.model_name)
    if is_decoder_dir(spec.path):  # a causal LM: replicas load its weights directly
        replica = ReplicaSpec(spec.name, "1", spec.path, None, config.engine, config.batching, config.cache,
                              config.limits, task="generate", generation=config.generation)
        return [DeploymentTarget(replica, ray_cfg)]
    artifact = resolve(spec, config.engine, config.cache_dir)
    replica = ReplicaSpec(spec.name, "1", spec.path, artifact, config.engine, config.batching, config.cache,
                          config.limits)
    return [DeploymentTarget(replica, ray_cfg)]


def plan_repository(config: ServerConfig, overrides: dict | None, resolve: Resolve) -> list[DeploymentTarget]:
    """Every model of `config.model_repository` (`<root>/<name>/<version>/model.yaml`),
    with the versions its version policy selects."""
    root = Path(config.model_repository).expanduser().resolve()
    if not root.is_dir():
        raise ConfigError(f"model repository {root} does not exist")
    targets = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))
                            and not (p / "pipeline.yaml").is_file()):
        for version, vdir, fields, yaml_file in _versions(root, model_dir.name):
            targets.append(_target(config, model_dir.name, version, vdir, fields, yaml_file, overrides, resolve))
    if not targets:
        raise ConfigError(f"model repository {root} has no model to serve")
    return targets


def _versions(root: Path, name: str):
    """(version, directory, merged model.yaml fields, file) of the versions to serve.

    Uses the repository's own scanner (runtime/repository.py: validation, version
    policy) when present; otherwise reads the layout directly and serves the newest.
    """
    try:
        from surge.runtime.repository import scan_model
    except ImportError:
        scan_model = None
    if scan_model is not None:
        entry = scan_model(root, name)
        if entry.error and not entry.versions:
            raise ConfigError(entry.error)
        for ventry in entry.versions.values():
            if ventry.error:
                # A deployment is planned up front: an invalid model.yaml stops it, naming file and field.
                raise ConfigError(ventry.error)
        for v in entry.desired():
            ventry = entry.versions[v]
            yield v, ventry.dir, _merged_yaml(root / name, ventry.dir), ventry.dir / "model.yaml"
        return
    versions = sorted((p for p in (root / name).iterdir() if p.is_dir() and p.name.isascii() and p.name.isdigit()),
                      key=lambda p: int(p.name))
    if not versions:
        raise ConfigError(f"{root / name}: no version directories (expected {root / name}/1/model.yaml)")
    newest = versions[-1]
    yield str(int(newest.name)), newest, _merged_yaml(root / name, newest), newest / "model.yaml"


def _merged_yaml(model_dir: Path, version_dir: Path) -> dict:
    data: dict = {}
    for path in (model_dir / "model.yaml", version_dir / "model.yaml"):
        if path.is_file():
            try:
                loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: invalid YAML: {exc}") from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: expected a mapping of fields at the top level")
            data = _deep_merge(data, loaded)
    return data


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _target(config: ServerConfig, name: str, version: str, vdir: Path, fields: dict, yaml_file: Path,
            overrides: dict | None, resolve: Resolve) -> DeploymentTarget:
    def section(key: str, schema, default):
        raw = fields.get(key)
        if raw is None:
            return default
        try:
            return schema.model_validate(_deep_merge(default.model_dump(), raw))
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ()))
            raise ConfigError(f"{yaml_file}: field '{key}.{where}': {err.get('msg')}", param=key) from None

    # A model's own sections override the server's field by field (so, e.g., the
    # shared Redis URL given on the command line reaches every model).
    engine = section("engine", EngineConfig, config.engine)
    batching = section("batching", BatchingConfig, config.batching)
    cache = section("cache", CacheConfig, config.cache)
    source = fields.get("source", "bundled")
    src = bundled_model_dir() if source == "bundled" else _rel(vdir, source)
    spec = load_model_spec(src, name=name)
    if is_decoder_dir(spec.path):
        generation = section("generation", GenerationConfig, config.generation)
        replica = ReplicaSpec(name, version, spec.path, None, engine, batching, cache, config.limits,
                              task="generate", generation=generation)
        return DeploymentTarget(replica, ray_config(fields.get("ray"), overrides, where=str(yaml_file)))
    artifact = _rel(vdir, fields["artifact"]) if fields.get("artifact") else resolve(spec, engine, config.cache_dir)
    replica = ReplicaSpec(name, version, spec.path, artifact, engine, batching, cache, config.limits)
    return DeploymentTarget(replica, ray_config(fields.get("ray"), overrides, where=str(yaml_file)))


def _rel(base: Path, value: str) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else (base / path).resolve()

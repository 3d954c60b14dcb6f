"""The model repository: `<root>/<name>/<version>/model.yaml`, loaded, unloaded and
reloaded at run time with zero downtime.

A new version is built, warmed up and made ready before it is put into the
registry (routing moves the moment it is added: `registry.get` serves the
newest loaded version); the version it replaces is then taken out of routing,
drained (its in-flight calls finish) and closed. A version that fails to load
leaves whatever is serving untouched, and the index reports why.

Building a service needs the artifact exporter, which lives on the offline side:
the CLI passes a `loader` callable in, so runtime/ never imports optimize/.

Names come from clients (HTTP paths, gRPC fields), so a name is only ever looked
up in the repository's own listing, never joined onto a path: `../x`, `/abs`,
`m/.` or `./m` are simply not in it. Every directory the listing offers (model,
version, artifact, pipeline) must resolve inside the root too, so a symlink
cannot lead out of it. Messages name files relative to the root.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from surge.config import ModelFile, load_yaml_file
from surge.errors import ConfigError, EngineError, InvalidInput, NotFound, SurgeError, relative_paths, shown
from surge.runtime.registry import ModelRegistry
from surge.runtime.served import ServedModel

log = logging.getLogger("surge.repository")

MODEL_YAML = "model.yaml"
PIPELINE_YAML = "pipeline.yaml"
CONFIG_PBTXT = "config.pbtxt"
READY, LOADING, UNAVAILABLE = "READY", "LOADING", "UNAVAILABLE"


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


Loader = Callable[[VersionEntry], object]  # builds a warmed-up ModelService (blocking)


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
    for sub in sorted(p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit()):
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


class ModelRepository:
    """Implements server.state.ModelLifecycle (index, load, unload) plus reload and polling."""

    def __init__(self, root: Path, registry: ModelRegistry, loader: Loader, *, poll_s: float | None = None,
                 drain_grace_s: float = 0.2, warmup_text: str = "surge warm-up"):
        self.root = Path(root).expanduser().resolve()
        self.registry = registry
        self.loader = loader
        self.poll_s = poll_s
        self.drain_grace_s = drain_grace_s
        self.warmup_text = warmup_text
        self._served: dict[tuple[str, str], ServedModel] = {}
        self._loaded_fp: dict[tuple[str, str], str] = {}
        self._failed_fp: dict[tuple[str, str], str] = {}  # polling does not retry an unchanged failure
        self._status: dict[tuple[str, str], tuple[str, str]] = {}  # -> (state, reason)
        self._locks: dict[str, asyncio.Lock] = {}
        self._user_unloaded: set[str] = set()
        self._poller: asyncio.Task | None = None

    # -- disk -------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        """The models: the root's directories (inside it, symlinks followed), pipelines excepted.
        The only names that load: every lifecycle call checks its name against this list."""
        if not self.root.is_dir():
            raise ConfigError(f"model repository {self.root} does not exist")
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith((".", "_")) and not (p / PIPELINE_YAML).is_file()
                      and inside(p, self.root))

    def pipeline_files(self) -> dict[str, Path]:
        """`<root>/<name>/pipeline.yaml` files: the pipelines the server loads after the models."""
        return {p.parent.name: p for p in sorted(self.root.glob(f"*/{PIPELINE_YAML}"))
                if not p.parent.name.startswith((".", "_")) and inside(p, self.root)}

    def scan(self, name: str) -> ModelEntry:
        names = self.model_names()
        if name not in names:  # an exact listed name: never a path built from what the client sent
            known = ", ".join(names) or "none"
            raise NotFound(f"model '{shown(name)}' is not in the repository; available: {shown(known, 512)}",
                           param="model")
        return scan_model(self.root, name)

    def relative(self, message: str) -> str:
        return relative_paths(message, self.root)

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Load every model as its version policy says; failures are reported, not fatal."""
        for name in self.model_names():
            try:
                await self._apply(self.scan(name))
            except SurgeError as exc:
                log.error("model %s: %s", name, exc.message)
        if self.poll_s:
            self._poller = asyncio.create_task(self._poll_loop(), name="surge-repository-poll")

    async def index(self) -> list[dict]:
        out: list[dict] = []
        seen: set[tuple[str, str]] = set()
        for name in self.model_names():
            entry = scan_model(self.root, name)
            if entry.error and not entry.versions:
                out.append({"name": name, "version": "", "state": UNAVAILABLE, "reason": entry.error})
            for v in entry.sorted_versions():
                out.append(self._describe(name, v, entry.versions[v]))
                seen.add((name, v))
        for (name, v) in sorted(self._served):
            if (name, v) not in seen:  # its directory is gone, but it still serves
                out.append(self._describe(name, v, None))
        return out

    def _describe(self, name: str, version: str, ventry: VersionEntry | None) -> dict:
        served = self._served.get((name, version))
        state, reason = self._status.get((name, version), (UNAVAILABLE, ""))
        if ventry is not None and ventry.error:
            if served is None:
                state, reason = UNAVAILABLE, ventry.error
            else:  # edited into an invalid file while serving: the loaded build stays
                reason = f"the loaded build keeps serving; {ventry.error}"
        if served is not None and not reason and getattr(served, "last_error", ""):
            reason = served.last_error  # e.g. a python model's worker that crashed and was restarted
        serving = served is not None and _is_routed(self.registry, name, served)
        return {"name": name, "version": version, "state": state, "reason": reason,
                "serving": serving, "inflight": served.inflight if served else 0}

    async def load(self, name: str, version: str | None = None) -> None:
        """Load a model as its policy says (or one version); an unchanged loaded version is kept."""
        await self._load(name, version, force=False)

    async def reload(self, name: str, version: str | None = None) -> None:
        """Rebuild the loaded versions (or the policy's) from model.yaml, swap them in, drain the old."""
        await self._load(name, version, force=True)

    async def _load(self, name: str, version: str | None, force: bool) -> None:
        entry = self.scan(name)
        self._user_unloaded.discard(name)
        if entry.error and not entry.versions:
            raise ConfigError(entry.error)
        if version is None:
            await self._apply(entry, force=force, explicit=True)
            return
        version = _check_version(version)
        ventry = entry.versions.get(version)
        if ventry is None:
            raise NotFound(f"model '{name}' has no version '{shown(version)}' in the repository "
                           f"(on disk: {', '.join(entry.sorted_versions()) or 'none'})", param="version")
        async with self._lock(name):
            await self._load_version(ventry, force=force, explicit=True)

    async def unload(self, name: str, version: str | None = None) -> None:
        """Take the model (or one version) out of routing, drain it, free it."""
        keys = [k for k in self._served if k[0] == name and (version is None or k[1] == str(version))]
        if not keys:
            if version is None:
                self.scan(name)  # NotFound when it is not in the repository at all
                raise NotFound(f"model '{shown(name)}' is not loaded", param="model")
            raise NotFound(f"model '{shown(name)}' version '{shown(version)}' is not loaded", param="version")
        if version is None:
            self._user_unloaded.add(name)  # polling leaves it alone until it is loaded again
        async with self._lock(name):
            for key in keys:
                await self._unload_version(key, "unloaded")

    async def close(self) -> None:
        if self._poller:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):
                pass
            self._poller = None

    # -- internals --------------------------------------------------------------------
    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _apply(self, entry: ModelEntry, *, force: bool = False, explicit: bool = False) -> None:
        """Bring the loaded versions in line with the version policy.

        Versions outside the policy are unloaded only once a wanted version is
        serving, so a failed load never leaves the model without a version.
        """
        name = entry.name
        async with self._lock(name):
            desired = entry.desired()
            errors: list[SurgeError] = []
            for v in reversed(desired):  # newest first: it is the one traffic moves to
                try:
                    await self._load_version(entry.versions[v], force=force, explicit=explicit)
                except SurgeError as exc:
                    errors.append(exc)
            bad = [entry.versions[v] for v in entry.sorted_versions() if entry.versions[v].error]
            for ventry in bad:
                self._status.setdefault((name, ventry.version), (UNAVAILABLE, ventry.error))
            if any((name, v) in self._served for v in desired):
                for key in [k for k in self._served if k[0] == name and k[1] not in desired]:
                    await self._unload_version(key, "unloaded: not in the version policy")
            if errors:
                raise errors[0]
            if explicit and not desired:
                why = bad[-1].error if bad else "no loadable version"
                raise ConfigError(f"model '{name}' has no version to load: {why}")

    async def _load_version(self, ventry: VersionEntry, *, force: bool, explicit: bool) -> None:
        key = (ventry.name, ventry.version)
        old = self._served.get(key)
        if ventry.config is None:
            raise ConfigError(ventry.error or f"{ventry.dir}: invalid {MODEL_YAML}")
        if old is not None and not force and self._loaded_fp.get(key) == ventry.fingerprint:
            return  # already serving this configuration
        if not explicit and self._failed_fp.get(key) == ventry.fingerprint:
            return  # failed before with this very model.yaml: wait for a change (or an explicit load)
        self._status[key] = (READY if old else LOADING, "reloading" if old else "loading")
        try:
            self._set_aliases(ventry)  # a clash fails the load, before building
            service = await asyncio.to_thread(self.loader, ventry)
            service.mark_ready()
            served = ServedModel(service)
            # Warm-up through the full path (tokenizer, batcher, engine) before any traffic.
            if getattr(service, "task", "embed") == "tensor":
                await service.warmup()  # random tensors of batch 1 (kinds onnx, torch)
            elif getattr(service, "task", "embed") == "generate":
                await service.warmup_request()  # one short generation (decoder models)
            else:
                await served.embed(texts=[self.warmup_text])
        except Exception as exc:  # noqa: BLE001 - any failure is reported the same way
            reason = self.relative(exc.message if isinstance(exc, SurgeError) else f"{type(exc).__name__}: {exc}")
            self._failed_fp[key] = ventry.fingerprint
            if old is not None:
                self._status[key] = (READY, f"reload failed, the previous build keeps serving: {reason}")
            else:
                self._status[key] = (UNAVAILABLE, f"load failed: {reason}")
            log.error("model %s version %s failed to load: %s", ventry.name, ventry.version, reason)
            serving = self._serving_version(ventry.name)
            keep = f"; version {serving} keeps serving" if serving else ""
            if isinstance(exc, ConfigError):
                raise ConfigError(f"{reason}{keep}", param=exc.param) from None
            raise EngineError(f"model '{ventry.name}' version {ventry.version} failed to load: {reason}{keep}") from None
        # The switch: one dict assignment, no await in between lookups and routing.
        self.registry.add(served)
        self._served[key] = served
        self._loaded_fp[key] = ventry.fingerprint
        self._failed_fp.pop(key, None)
        self._status[key] = (READY, "")
        log.info("serving %s version %s", ventry.name, ventry.version)
        if old is not None:
            await self._retire(old)

    def _set_aliases(self, ventry: VersionEntry) -> None:
        # Checked against every model of the repository, loaded or not, so that
        # the outcome does not depend on the order in which models load.
        models = self._model_dirs()
        for alias in ventry.config.aliases:
            if alias != ventry.name and alias in models:
                raise ConfigError(f"{ventry.dir / MODEL_YAML}: field 'aliases': alias '{alias}' is the name of "
                                  "another model in the repository", param="aliases")
        self.registry.set_aliases(ventry.name, ventry.config.aliases)

    def _model_dirs(self) -> set[str]:
        try:
            return set(self.model_names())
        except ConfigError:
            return set()

    async def _unload_version(self, key: tuple[str, str], reason: str) -> None:
        served = self._served.pop(key, None)
        self._loaded_fp.pop(key, None)
        if served is None:
            return
        if _is_routed(self.registry, key[0], served):
            self.registry.remove(*key)
        self._status[key] = (UNAVAILABLE, reason)
        await self._retire(served)
        log.info("unloaded %s version %s", *key)

    async def _retire(self, served: ServedModel) -> None:
        await served.drain(self.drain_grace_s)
        await served.close()
        del served
        _release_memory()

    def _serving_version(self, name: str) -> str | None:
        try:
            return self.registry.get(name).version
        except NotFound:
            return None

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        """Rescan: load new versions or models, reload changed model.yaml, drop removed versions."""
        try:
            names = self.model_names()
        except ConfigError as exc:
            log.error("%s", exc.message)
            return
        for name in set(names) | {k[0] for k in self._served}:
            if name in self._user_unloaded:
                continue
            try:
                entry = scan_model(self.root, name) if name in names else ModelEntry(name)
                await self._apply(entry)
            except SurgeError as exc:
                log.error("model %s: %s", name, exc.message)
            except Exception:  # keep polling whatever happens to one model
                log.exception("polling model %s", name)


def _is_routed(registry: ModelRegistry, name: str, served: ServedModel) -> bool:
    try:
        return registry.get(name, served.version) is served
    except NotFound:
        return False


def _check_version(version) -> str:
    version = str(version)
    if not version.isdigit():
        raise InvalidInput(f"version must be a positive integer, got '{shown(version)}'", param="version")
    return str(int(version))


def _release_memory() -> None:
    """Hand freed engine memory back to the OS, so repeated reloads do not grow RSS.

    A closed service is freed by reference counting (no cycles hold it), so no
    full gc pass is forced here: it would stall the event loop for ~0.2 s.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

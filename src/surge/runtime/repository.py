"""The model repository: `<root>/<name>/<version>/model.yaml`, loaded, unloaded and
reloaded at run time with zero downtime.

A new version is built, warmed up and made ready before it is put into the
registry (routing moves the moment it is added: `registry.get` serves the
newest loaded version); the version it replaces is then taken out of routing,
drained (its in-flight calls finish) and closed. A version that fails to load
leaves whatever is serving untouched, and the index reports why.

Building a service needs the artifact exporter, which lives on the offline side:
the CLI passes a `loader` callable in, so runtime/ never imports optimize/.

Where the entries come from is a catalog: `DiskCatalog` reads a repository
directory (`--model-repository`); `surge serve MODEL` passes a catalog of one
entry (cli/single_model.py), so both modes load, warm up, swap, drain and free
models with this one code.

Names come from clients (HTTP paths, gRPC fields), so a name is only ever looked
up in the repository's own listing, never joined onto a path: `../x`, `/abs`,
`m/.` or `./m` are simply not in it. Every directory the listing offers (model,
version, artifact, pipeline) must resolve inside the root too, so a symlink
cannot lead out of it. Messages name files relative to the root.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import weakref
from pathlib import Path
from typing import Callable

from surge.errors import ConfigError, EngineError, InvalidInput, NotFound, NotReady, SurgeError, shown
from surge.runtime.catalog import (CONFIG_PBTXT, MODEL_YAML, PIPELINE_YAML, DiskCatalog, ModelEntry,  # noqa: F401
                                   VersionEntry, inside, scan_model)
from surge.runtime.gc_settle import resettle
from surge.runtime.registry import ModelRegistry
from surge.runtime.served import ServedModel

log = logging.getLogger("surge.repository")

READY, LOADING, UNAVAILABLE = "READY", "LOADING", "UNAVAILABLE"


Loader = Callable[[VersionEntry], object]  # builds a warmed-up ModelService (blocking)


class ModelRepository:
    """Implements server.state.ModelLifecycle (index, load, unload) plus reload and polling.

    `source`: a repository directory, or a catalog (names, scan, read, pipelines, relative).
    `reload_on_load`: a load of a loaded, unchanged version rebuilds it (single-model serving:
    its configuration never changes on disk, so a load is asked for to rebuild)."""

    def __init__(self, source, registry: ModelRegistry, loader: Loader, *, poll_s: float | None = None,
                 drain_grace_s: float = 0.2, warmup_text: str = "surge warm-up", reload_on_load: bool = False):
        self.catalog = source if hasattr(source, "scan") else DiskCatalog(source)
        self.root = getattr(self.catalog, "root", None)
        self.reload_on_load = reload_on_load
        self._background: set[asyncio.Task] = set()
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
        """The models: the catalog's names (a repository's directories, pipelines excepted).
        The only names that load: every lifecycle call checks its name against this list."""
        return self.catalog.names()

    def pipeline_files(self) -> dict[str, Path]:
        """`<root>/<name>/pipeline.yaml` files: the pipelines the server loads after the models."""
        return self.catalog.pipelines()

    def scan(self, name: str) -> ModelEntry:
        return self.catalog.scan(name)

    def relative(self, message: str) -> str:
        return self.catalog.relative(message)

    # -- lifecycle --------------------------------------------------------------------
    async def start(self, strict: bool = False) -> None:
        """Load every model as its version policy says; failures are reported, not fatal
        (`strict`: the first one is raised, once every model was tried)."""
        errors: list[SurgeError] = []
        for name in self.model_names():
            try:
                await self._apply(self.scan(name), explicit=strict)
            except SurgeError as exc:
                log.error("model %s: %s", name, exc.message)
                errors.append(exc)
        if strict and errors:
            raise errors[0]
        if self.poll_s:
            self._poller = asyncio.create_task(self._poll_loop(), name="surge-repository-poll")

    async def index(self) -> list[dict]:
        out: list[dict] = []
        seen: set[tuple[str, str]] = set()
        for name in self.model_names():
            entry = self.catalog.read(name)
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
        down = getattr(served, "unavailable_reason", "") if served is not None else ""
        if down and state == READY:  # loaded, but cannot serve now (a python model's workers are down)
            state, reason = UNAVAILABLE, down
        serving = served is not None and _is_routed(self.registry, name, served)
        return {"name": name, "version": version, "state": state, "reason": reason,
                "serving": serving, "inflight": served.inflight if served else 0}

    async def load(self, name: str, version: str | None = None) -> None:
        """Load a model as its policy says (or one version); an unchanged loaded version is kept."""
        await self._load(name, version, force=self.reload_on_load)

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
        """Stop polling, then drain and free every loaded version (the server is stopping:
        SIGTERM). Routing stops first; calls in flight finish; the versions drain together."""
        if self._poller:
            self._poller.cancel()
            try:
                await self._poller
            except (asyncio.CancelledError, Exception):
                pass
            self._poller = None
        for task in list(self._background):
            task.cancel()
        served = list(self._served)
        for key in served:
            self._status[key] = (UNAVAILABLE, "the server is stopping")
        await asyncio.gather(*(self._unload_version(key, "the server stopped", free=False) for key in served),
                             return_exceptions=True)

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
        service = None
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
                await served.warmup(self.warmup_text)  # embed, or the model's task head (issue 17)
        except Exception as exc:  # noqa: BLE001 - any failure is reported the same way
            reason = self.relative(exc.message if isinstance(exc, SurgeError) else f"{type(exc).__name__}: {exc}")
            self._failed_fp[key] = ventry.fingerprint
            if old is not None:
                self._status[key] = (READY, f"reload failed, the previous build keeps serving: {reason}")
            else:
                self._status[key] = (UNAVAILABLE, f"load failed: {reason}")
            log.error("model %s version %s failed to load: %s", ventry.name, ventry.version, reason)
            if service is not None:  # built, then its warm-up failed: free it (batcher, threads, engine, metrics)
                try:
                    await service.close()
                except Exception:  # the load's own error is the one reported
                    log.exception("closing the failed build of %s version %s", ventry.name, ventry.version)
            serving = self._serving_version(ventry.name)
            keep = f"; version {serving} keeps serving" if serving else ""
            if isinstance(exc, ConfigError):
                raise ConfigError(f"{reason}{keep}", param=exc.param) from None
            raise EngineError(f"model '{ventry.name}' version {ventry.version} failed to load: {reason}{keep}") from None
        if old is not None:
            await _carry_adapters(old, service)
        # The switch: one dict assignment, no await in between lookups and routing.
        self.registry.add(served)
        if old is not None:
            self._drop_stale_views(old, served)
        self._served[key] = served
        self._loaded_fp[key] = ventry.fingerprint
        self._failed_fp.pop(key, None)
        self._status[key] = (READY, "")
        log.info("serving %s version %s", ventry.name, ventry.version)
        self._prefill(service)
        if old is not None:
            await self._retire(old)
            gone = _watch(old)
            old = None  # its last reference: reference counting frees it here; the new build is frozen below
            await _free_retired(gone)
        else:
            resettle(thaw=False)  # the new build's objects frozen too: full collections skip them

    def _drop_stale_views(self, old: ServedModel, new: ServedModel) -> None:
        """The replaced build's views (a decoder's LoRA adapters, a multi-head model's heads) that the new
        build does not register again leave routing with it: left there, they would route to the retired
        build (closed: its name answers "not ready", the server's /ready fails, its memory is held)."""
        kept = {v.name for v in getattr(new, "views", None) or ()}
        for view in list(getattr(old, "views", None) or ()):
            if view.name not in kept and _is_routed(self.registry, view.name, view):
                self.registry.remove(view.name, view.version)

    def _prefill(self, service) -> None:
        """A query log's pinned queries computed in the background (low priority) once serving."""
        cache = getattr(service, "cache", None)
        if getattr(cache, "static_hot", None) and hasattr(service, "prefill_pinned"):
            task = asyncio.create_task(service.prefill_pinned(), name="surge-prefill-pinned")
            self._background.add(task)
            task.add_done_callback(self._background.discard)

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

    async def _unload_version(self, key: tuple[str, str], reason: str, free: bool = True) -> None:
        """`free`: collect the retired build at once (close() leaves it to the process's exit)."""
        served = self._served.pop(key, None)
        self._loaded_fp.pop(key, None)
        if served is None:
            return
        if _is_routed(self.registry, key[0], served):
            self.registry.remove(*key)
        self._status[key] = (UNAVAILABLE, reason)
        await self._retire(served)
        gone = _watch(served)
        served = None  # its last reference
        if free:
            await _free_retired(gone)
        log.info("unloaded %s version %s", *key)

    async def _retire(self, served: ServedModel) -> None:
        await served.drain(self.drain_grace_s)
        await served.close()

    def _serving_version(self, name: str) -> str | None:
        try:
            return self.registry.get(name).version
        except (NotFound, NotReady):  # NotReady: nothing served yet while the server starts
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
                entry = self.catalog.read(name) if name in names else ModelEntry(name)
                await self._apply(entry)
            except SurgeError as exc:
                log.error("model %s: %s", name, exc.message)
            except Exception:  # keep polling whatever happens to one model
                log.exception("polling model %s", name)


async def _carry_adapters(old, service) -> None:
    """LoRA adapters loaded at run time into the build being replaced (POST /v1/load_lora_adapter) are loaded
    into the new build too, where it takes adapters at run time (its model.yaml's own adapters it has
    already): a reload keeps serving them. One that no longer loads is left out, and logged."""
    adapters = getattr(getattr(old, "service", old), "adapters", None)
    if not adapters or not getattr(service, "runtime_adapters", False):
        return
    for name, adapter in list(adapters.items()):
        if name in service.adapters:
            continue
        try:
            checked = await asyncio.to_thread(service.check_adapter, name, adapter.path)
            service.add_adapter(name, adapter.path, checked)
        except SurgeError as exc:
            log.warning("model %s: LoRA adapter '%s' is not loaded into the new build: %s", service.name, name,
                        exc.message)


def _is_routed(registry: ModelRegistry, name: str, served: ServedModel) -> bool:
    try:
        return registry.get(name, served.version) is served
    except NotFound:
        return False


def _check_version(version) -> str:
    version = str(version)
    if not (version.isascii() and version.isdigit()):  # "²".isdigit() holds, but int("²") raises
        raise InvalidInput(f"version must be a positive integer, got '{shown(version)}'", param="version")
    return str(int(version))


def _watch(served: ServedModel) -> list[weakref.ref]:
    """Weak references to a retired build's service and the parts that hold its memory (engines, cache)."""
    service = served.service
    parts = [served, service, getattr(service, "worker", None), getattr(service, "batcher", None),
             getattr(service, "cache", None), getattr(service, "engine", None)]
    parts += list(getattr(getattr(getattr(service, "worker", None), "engines", None), "engines", None) or ())
    refs = []
    for part in parts:
        try:
            refs.append(weakref.ref(part))
        except TypeError:  # None, or a type without weak references: not watched
            pass
    return refs


async def _free_retired(gone: list[weakref.ref]) -> None:
    """After a build's retirement (its last reference dropped): reference counting has freed it, frozen or
    not (runtime/gc_settle.py), as no reference cycle holds a built service; the new build, if any, is
    collected and frozen (a pass over what is not frozen: a few ms). Safety net: a part of the retired build
    still alive after one more loop pass (a cycle that only the collector frees) gets the full pass of the
    whole heap unfrozen (50-300 ms of GIL), logged."""
    if any(r() is not None for r in gone):
        await asyncio.sleep(0)  # what the retiring task step still held (its C frames) is let go
    left = [r() for r in gone if r() is not None]
    if left:
        log.warning("a retired build is still referenced (%s): a full collection frees it",
                    ", ".join(sorted({type(o).__name__ for o in left})))
    del left
    resettle(thaw=any(r() is not None for r in gone))
    _release_memory()


_libc: list = []  # libc, loaded once: each ctypes.CDLL() makes a function-pointer class, a reference cycle


def _release_memory() -> None:
    """Hand freed engine memory back to the OS, so repeated reloads do not grow RSS."""
    try:
        if not _libc:
            _libc.append(ctypes.CDLL("libc.so.6"))
        _libc[0].malloc_trim(0)
    except (OSError, AttributeError):
        pass

"""`--model-repository` under `--workers N`: one engine process runs the repository, front ends follow it.

The engine process runs the whole lifecycle as one process would (runtime/repository.ModelRepository:
loading, warm-up, version policy, polling, zero-downtime swaps, drain). Each served build gets a
*slot*, the number its token batches carry on the wire; after every change of its registry the engine
process sends all front ends a CATALOG (slots, names, versions, aliases, what a front end needs to
tokenize and post-process). A front end keeps one thin ModelService per slot (its tokenizer, its
cache; its batcher is the engine connection bound to the slot) and routes by name and version as
one process does. Repository calls (index, load, unload, reload) from any front end's HTTP or gRPC
API run in the engine process (CONTROL / REPLY frames).

Zero downtime across processes: a front end may still send to a build that the engine process has
just replaced (its CATALOG is on the way); such a batch goes to the build that serves that version
now (a reload) or the model's newest version, never to a closed batcher. A retired build drains in
the engine process as it does in one process.

Embedding models, and decoders: a decoder version's engine loop runs in the engine process behind
a socket of its own, which its CATALOG entry names and every front end streams through
(cli/workers_generate.py). Task heads and tensor / python models fail to load with a message that
says so (the index reports it; everything else keeps serving). With several engine processes
(`--engine-processes`, default 2 with 8 or more front ends) each runs the repository (each its own
copy of every model on the device, each polling); a front end sends its requests to its own engine
process and every repository call to all of them.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import replace

from surge.errors import ConfigError, InvalidInput, NotFound, shown

log = logging.getLogger("surge.workers")

# waits between a front end's attempts to connect to a decoder build (the last one repeats)
CONNECT_RETRY_S = (0.5, 1.0, 2.0, 5.0)

WORKERS_ONLY_EMBED = ("is served with --workers 1 only: under --workers N front ends hand token batches to "
                      "the engine process, which serves embedding and decoder models")


def check_embedding(entry) -> None:
    """Refuse, before building, what the engine process cannot serve to front ends."""
    cfg = entry.config
    if cfg is None:
        return  # the repository reports the invalid model.yaml itself
    if cfg.kind != "hf":
        raise ConfigError(f"model '{entry.name}': kind '{cfg.kind}' {WORKERS_ONLY_EMBED}", param="kind")
    if cfg.heads or (cfg.task not in (None, "embed", "generate")):
        raise ConfigError(f"model '{entry.name}': task '{cfg.task or 'heads'}' {WORKERS_ONLY_EMBED}", param="task")


class ModelSlots:
    """The engine process's served embedding builds by slot, and the repository calls.

    `EngineServer(models=...)` asks `batcher(slot)` for each request's batcher,
    `catalog()` for what front ends get, `control(obj)` for repository calls, and sets `on_change`."""

    def __init__(self, registry, repo):
        self.registry, self.repo = registry, repo
        self._slot_of: dict[int, int] = {}  # id(served) -> slot
        self._served: dict[int, object] = {}  # slot -> served (ServedModel)
        self._retired: dict[int, tuple[str, str]] = {}  # slot -> (name, version) of a replaced build
        self._generators: list = []  # decoder builds (cli/workers_generate.HubBuild) served now
        # Numbering starts at a random base: after a restart of this process, a front end's batch sent
        # before the new CATALOG reached it names a slot unknown here (404), never another model's.
        self._next = (secrets.randbits(15) + 1) << 16
        self.on_change = None
        registry.subscribe(self._sync)

    def _sync(self) -> None:
        seen = set()
        generators = []
        for s in self.registry.services():
            inner = getattr(s, "service", s)
            if hasattr(inner, "catalog_entry"):  # a decoder: front ends connect to its own socket
                generators.append(inner)
                continue
            if getattr(inner, "task", "embed") != "embed" or not hasattr(getattr(inner, "batcher", None), "enqueue"):
                continue
            seen.add(id(s))
            if id(s) not in self._slot_of:
                self._slot_of[id(s)] = self._next
                self._served[self._next] = s
                self._next += 1
        for key, slot in list(self._slot_of.items()):
            if key not in seen:
                del self._slot_of[key]
                s = self._served.pop(slot)
                self._retired[slot] = (s.name, s.version)
                if len(self._retired) > 4096:  # only batches sent just before a swap name these
                    del self._retired[next(iter(self._retired))]
        self._generators = generators
        if self.on_change is not None:
            self.on_change()

    def batcher(self, slot: int):
        """The batcher for a request sent to `slot` (see `service`)."""
        return self.service(slot).batcher

    def service(self, slot: int):
        """The service for a request sent to `slot`; a replaced build's requests go to the build
        serving its version now, else the model's newest version."""
        s = self._served.get(slot)
        if s is None or getattr(s.service.batcher, "_closed", False):
            name, version = self._retired.get(slot) or ((s.name, s.version) if s is not None else (None, None))
            if name is None:
                raise NotFound(f"no model is served under slot {slot}")
            s = None
            for v in (version, None):
                try:
                    cand = self.registry.get(name, v)
                except NotFound:
                    continue
                if id(cand) in self._slot_of:
                    s = cand
                    break
            if s is None:
                raise NotFound(f"model '{shown(name)}' is not loaded", param="model")
        return s.service

    def services(self) -> list:
        """The local services served now (one per slot)."""
        return [s.service for s in self._served.values()]

    def catalog(self) -> dict:
        models = []
        for slot, s in sorted(self._served.items()):
            w = s.service.worker
            caps = w.engines.capabilities
            models.append({
                "slot": slot, "name": s.name, "version": s.version, "spec_dir": str(w.spec.path),
                "tokenizer_file": str(w.spec.tokenizer_file), "max_length": w.tokenizer.max_length,
                "vocab_size": w.tokenizer.vocab_size, "pad_id": w.tokenizer.pad_id,
                "pooling": w.post.pooling, "normalize": w.post.normalize, "tokens": s.service.can_return_tokens,
                "caps": [caps.max_batch, caps.max_tokens, caps.layout.value, caps.device, caps.dtype,
                         caps.hidden_size],
                "fingerprint": w.fingerprint()})
        try:
            names = self.repo.model_names()
        except ConfigError:
            names = []
        return {"models": models, "generators": [g.catalog_entry() for g in self._generators], "names": names,
                "aliases": self.registry.aliases()}

    async def control(self, obj: dict):
        op, name, version = obj.get("op"), obj.get("name"), obj.get("version")
        if op == "index":
            return await self.repo.index()
        if op in ("load", "unload", "reload"):
            await getattr(self.repo, op)(name, version)
            return None
        raise InvalidInput(f"unknown repository call {shown(str(op))!r}")


class RemoteRepository:
    """A front end's repository API (server.state.ModelLifecycle): the engine processes run the calls.

    `client`: this front end's engine process (its index is the answer); `others`: the other engine
    processes, each running the same repository, which get every load / unload / reload too, so
    that every front end serves the result whichever engine process it talks to."""

    def __init__(self, client, others=()):
        self.client = client
        self.others = list(others)
        self._connected = False

    def model_names(self) -> list[str]:
        return list((self.client.catalog or {}).get("names", []))

    async def index(self) -> list[dict]:
        return await self.client.control("index")

    async def _everywhere(self, op: str, name: str, version: str | None) -> None:
        if self.others and not self._connected:
            await asyncio.gather(*(c.connect(timeout_s=30) for c in self.others))
            self._connected = True
        results = await asyncio.gather(*(c.control(op, name=name, version=version)
                                         for c in [self.client, *self.others]), return_exceptions=True)
        for r in results:  # this front end's engine's answer first
            if isinstance(r, BaseException):
                raise r

    async def load(self, name: str, version: str | None = None) -> None:
        await self._everywhere("load", name, version)

    async def unload(self, name: str, version: str | None = None) -> None:
        await self._everywhere("unload", name, version)

    async def reload(self, name: str, version: str | None = None) -> None:
        await self._everywhere("reload", name, version)


class FrontModels:
    """A front end's services, one per slot of the engine's CATALOG, kept in its registry."""

    def __init__(self, state, client, build, build_generator=None):
        """`build(entry) -> ModelService`: a front-end service for one CATALOG entry;
        `await build_generator(entry) -> GenerateService` one for a decoder's (cli/workers_generate.py)."""
        self.state, self.client, self.build, self.build_generator = state, client, build, build_generator
        self.services: dict[int, object] = {}
        self.generators: dict[str, object] = {}  # by the build's socket
        self._wanted_gens: dict[str, dict] = {}  # the last CATALOG's decoder builds, by socket
        self._connecting: dict[str, asyncio.Task] = {}  # decoder builds not served here yet
        self._tried: dict[str, asyncio.Future] = {}  # set once a build's first connect attempt ended
        self._retiring: set[asyncio.Task] = set()
        self.synced = asyncio.Event()  # set by the first CATALOG: the front end is ready after it

    def sync(self, catalog: dict) -> None:
        reg = self.state.registry
        want = {m["slot"]: m for m in catalog.get("models", [])}
        self._add(self.services, want, self.build)  # new builds first: routing moves as each is added
        gens = {g["hub"]: g for g in catalog.get("generators", [])} if self.build_generator else {}
        self._wanted_gens = gens
        for hub, entry in gens.items():
            if hub not in self.generators and hub not in self._connecting:
                self._connect_generator(hub, entry)
        for slot in [s for s in self.services if s not in want]:
            self._unroute(self.services.pop(slot))
        for hub in [h for h in self.generators if h not in gens]:
            from surge.cli.workers_generate import retire

            svc = self.generators.pop(hub)
            self._unroute(svc)
            task = asyncio.ensure_future(retire(svc))  # its streams finish on it first
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
        by_model: dict[str, list[str]] = {}
        for alias, name in catalog.get("aliases", {}).items():
            by_model.setdefault(name, []).append(alias)
        for name in set(by_model) | set(reg.aliases().values()):
            try:
                reg.set_aliases(name, by_model.get(name, []))
            except ConfigError as exc:
                log.error("front end: %s", exc.message)
        self.synced.set()

    def _connect_generator(self, hub: str, entry: dict) -> None:
        """Connect to a decoder build off this event loop, in a task of its own: the front end keeps
        serving everything else meanwhile. An attempt that fails (the build is starting again, stalled,
        or slow to answer) is tried again after a capped backoff for as long as the CATALOG lists the
        build, so the model comes to this front end once its build answers."""
        tried = asyncio.get_running_loop().create_future()
        self._tried[hub] = tried

        async def run() -> None:
            attempt = 0
            while hub in self._wanted_gens:
                try:
                    svc = await self.build_generator(entry)
                except Exception as exc:  # noqa: BLE001 - this build only; everything else keeps serving
                    delay = CONNECT_RETRY_S[min(attempt, len(CONNECT_RETRY_S) - 1)]
                    log.warning("front end: model %s version %s: connecting to its build failed (%s); "
                                "trying again in %.1f s", entry.get("name"), entry.get("version"), exc, delay)
                    attempt += 1
                    if not tried.done():
                        tried.set_result(False)
                    await asyncio.sleep(delay)  # the backoff between attempts
                    continue
                if hub not in self._wanted_gens:  # unloaded while it connected
                    from surge.cli.workers_generate import retire

                    await retire(svc)
                    return
                svc.mark_ready()
                self.generators[hub] = svc
                self.state.registry.add(svc)
                log.info("front end: model %s version %s serves here", svc.name, svc.version)
                return

        def done(_task) -> None:
            self._connecting.pop(hub, None)
            self._tried.pop(hub, None)
            if not tried.done():
                tried.set_result(True)

        task = asyncio.ensure_future(run())
        self._connecting[hub] = task
        task.add_done_callback(done)

    async def first_attempts(self) -> None:
        """Until every decoder build of the CATALOG has had one connect attempt (served here, or
        being tried again): the front end says it is ready with what it serves by then."""
        if self._tried:
            await asyncio.wait(list(self._tried.values()))

    def _add(self, held: dict, wanted: dict, build) -> None:
        """Build and route each entry of `wanted` that `held` has not."""
        for key, entry in wanted.items():
            if key in held:
                continue
            try:
                svc = build(entry)
            except Exception:  # noqa: BLE001 - one model's files or build; the others keep serving
                log.exception("front end: model %s version %s", entry.get("name"), entry.get("version"))
                continue
            svc.mark_ready()
            held[key] = svc
            self.state.registry.add(svc)

    def _unroute(self, svc) -> None:
        reg = self.state.registry
        try:
            routed = reg.get(svc.name, svc.version) is svc
        except NotFound:
            routed = False
        if routed:
            reg.remove(svc.name, svc.version)

    def set_ready(self, up: bool) -> None:
        for svc in self.services.values():
            svc.ready = up


def front_service(config, entry: dict, client):
    """One CATALOG entry as a front-end ModelService: tokenizer and post-processing here, the
    engine behind the connection bound to its slot."""
    from surge.cli.workers import RemoteEngines
    from surge.engines.base import Capabilities
    from surge.models import load_model_spec
    from surge.runtime.service import ModelService
    from surge.runtime.tokenize import Tokenizer
    from surge.runtime.worker import ModelWorker, PostSpec
    from surge.types import Layout

    spec = replace(load_model_spec(entry["spec_dir"]), name=entry["name"])
    b, t, layout, device, dtype, hidden = entry["caps"]
    caps = Capabilities(b, t, Layout(layout), device, dtype, hidden)
    tok = Tokenizer(entry["tokenizer_file"], max_length=entry["max_length"], vocab_size=entry["vocab_size"],
                    pad_id=entry["pad_id"])
    worker = ModelWorker(spec, tok, RemoteEngines(caps), PostSpec(entry["pooling"], entry["normalize"]))
    fingerprint = entry["fingerprint"]
    worker.fingerprint = lambda: fingerprint
    return ModelService(entry["name"], entry["version"], worker, batching=config.batching, cache=config.cache,
                        limits=config.limits, batcher=client.bound(entry["slot"], entry.get("tokens", False)))

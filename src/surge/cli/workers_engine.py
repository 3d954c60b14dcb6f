"""The engine process of `surge serve --workers N` (cli/workers.py has the supervisor and the front
ends): the engines and their continuous batcher behind the IPC socket (runtime/ipc.py EngineServer),
and its own HTTP stack for the lone connections front ends hand over (`EngineHttp`,
server/http/handoff.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from surge.cli.workers import whole_metrics
from surge.config import ServerConfig

def engine_main(config_json: str, sock: str, *flags: str) -> None:
    """`flags`: "restarted" when the supervisor starts it again."""
    from surge.runtime.ipc import EngineServer

    config = ServerConfig.model_validate_json(config_json)
    if config.model_repository is None:
        from surge.models import bundled_model_dir, load_model_spec

        spec = load_model_spec(config.model_dir or bundled_model_dir(), name=config.model_name)
        if spec.task == "generate":  # the decoder's engine loop, shared by the front ends
            from surge.runtime.generate_hub import engine_main as hub_main

            hub_main(config, spec, sock, restarted="restarted" in flags)
            return
    try:  # nothing else in this process wants the GIL: keep two batches in flight per instance
        from surge.engines import torch_gpu

        torch_gpu.DEFAULT_PIPELINE_DEPTH = int(os.environ.get("SURGE_PIPELINE_DEPTH", "2"))
    except ImportError:  # no torch: CPU engines only
        pass
    repo = slots = service = None
    if config.model_repository is not None:
        repo, slots = _engine_repository(config, os.path.dirname(sock))
        hello = {"repository": True}
    else:
        from surge.cli.bootstrap import load_service
        from surge.models import bundled_model_dir, load_model_spec

        spec = load_model_spec(config.model_dir or bundled_model_dir(), name=config.model_name)
        service = load_service(config, spec)  # engines built and warmed up (every bucket) here
        service.mark_ready()  # its own requests (TOKENS: runtime/token_states.of_tokens) are admitted only then
        caps = service.worker.engines.capabilities
        hello = {"max_batch": caps.max_batch, "max_tokens": caps.max_tokens, "layout": caps.layout.value,
                 "device": caps.device, "dtype": caps.dtype, "hidden": caps.hidden_size,
                 "fingerprint": service.worker.fingerprint(), "tokens": service.can_return_tokens}
    # The event loop (IPC, batching) and the engine threads take turns on the GIL many times per
    # batch; a thread that wants it waits up to the switch interval (the engines set 0.5 ms). This
    # process runs no long pure-Python stretches, so a shorter interval only shortens the waits.
    sys.setswitchinterval(float(os.environ.get("SURGE_ENGINE_SWITCH_S", "0.00005")))

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, lambda: None)  # the supervisor decides
        if repo is not None:
            await repo.start()  # every model as its policy says, warmed up, before the socket appears
        from surge.runtime.gc_settle import settle

        settle(config.gc_freeze)  # engines built: keep full GC passes from walking them (runtime/gc_settle.py)
        server = EngineServer(service.batcher if service is not None else None, hello, models=slots, service=service)
        part = sock + ".part"
        for p in (part, sock):
            if os.path.exists(p):
                os.unlink(p)
        http = None
        if service is not None and config.engine_connections > 0:
            try:  # before the socket appears: front ends hand over from their first connection
                http = EngineHttp(config, service, sock, server)
            except ImportError:  # no httptools: front ends serve every connection (they offer none)
                http = None
        srv = await server.serve(part)
        os.replace(part, sock)  # appears complete: the supervisor and front ends wait for this path
        builds = loop.create_task(_export_builds(
            (lambda: [service]) if service is not None else slots.services))
        await stop.wait()
        builds.cancel()
        if http is not None:
            await http.close()  # its connections drain before the engines close
        srv.close()
        if repo is not None:
            await repo.close()  # every version drained and freed
        else:
            await service.close()

    run_loop(main())


class EngineHttp:
    """The engine process's own HTTP stack, for the connections front ends hand over
    (server/http/handoff.py): the same app as a front end's, on this process's service (its
    batcher directly, no hop), at most --engine-connections connections at a time."""

    def __init__(self, config: ServerConfig, service, sock: str, ipc):
        """`ipc`: the process's EngineServer (front ends' requests in flight; hand-backs)."""
        import uvicorn

        from surge.runtime.registry import ModelRegistry
        from surge.server.app import create_app
        from surge.server.http.frontend import FrontDoor, HandedProtocol
        from surge.server.http.handoff import Intake
        from surge.server.state import AppState

        state = AppState(config=config, registry=ModelRegistry())
        service.mark_ready()  # engines built and every bucket warmed up (load_service)
        state.registry.add(service)
        whole_metrics(state, config)
        # The service's lifecycle is this process's (engine_main closes it): no lifespan here.
        state.started = True
        ucfg = uvicorn.Config(FrontDoor(create_app(state)), log_level=config.log_level, access_log=False,
                              lifespan="off", timeout_graceful_shutdown=10, http=HandedProtocol)
        ucfg.load()
        server = self.server = uvicorn.Server(ucfg)
        server.lifespan = ucfg.lifespan_class(ucfg)
        server.servers = []

        def protocol(handed):
            p = HandedProtocol(config=ucfg, server_state=server.server_state, app_state=server.lifespan.state)
            p.handed = handed
            return p

        self.intake = Intake(sock, protocol, give_back=ipc.return_connection, busy=lambda: ipc.inflight > 0)
        self.intake.start()
        self._ticks = asyncio.get_running_loop().create_task(self._tick())

    async def _tick(self) -> None:
        while True:  # uvicorn's once-a-second work (the Date header)
            await self.server.on_tick(0)
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        self.intake.stop()
        self._ticks.cancel()
        await self.server.shutdown()


def _engine_repository(config: ServerConfig, sock_dir: str):
    """The engine process's repository (cli/workers_repo.py): every embedding and decoder model of
    the directory, loaded and swapped by ModelRepository as in one process (a decoder's build listens
    on a socket of its own in `sock_dir`, cli/workers_generate.py)."""
    from surge.cli.bootstrap import decoder_settings, load_repository_version
    from surge.cli.workers_generate import HubBuild
    from surge.cli.workers_repo import WORKERS_ONLY_EMBED, ModelSlots, check_embedding
    from surge.errors import ConfigError
    from surge.runtime.registry import ModelRegistry
    from surge.runtime.repository import DiskCatalog, ModelRepository

    def loader(entry):
        check_embedding(entry)
        decoder = decoder_settings(config, entry)
        if decoder is not None:
            spec, engine, generation = decoder
            return HubBuild(spec, entry.version, engine, generation, sock_dir, config.limits.request_timeout_s)
        service = load_repository_version(config, entry)
        task = getattr(service, "task", "embed")
        if task != "embed" or not hasattr(getattr(service, "batcher", None), "enqueue"):
            try:
                asyncio.run(service.close())
            except Exception:  # noqa: BLE001 - refusing it matters more than freeing it neatly
                pass
            raise ConfigError(f"model '{entry.name}': task '{task}' {WORKERS_ONLY_EMBED}", param="task")
        return service

    registry = ModelRegistry()
    repo = ModelRepository(DiskCatalog(config.model_repository), registry, loader=loader,
                           poll_s=config.repository_poll_s)
    return repo, ModelSlots(registry, repo)


async def _export_builds(services, every_s: float = 1.0) -> None:
    """The engine-build counts (surge_engine_graph_builds_total, by phase) on every front end's /metrics.

    In one process a collector reads them off the engines at scrape time; here the engines are in
    this process and the front ends read prometheus_client's multiprocess files, so the counts are
    written there (a gauge summed over live engine processes), refreshed every second.
    `services()`: the services served now (one, or a repository's)."""
    from prometheus_client import CollectorRegistry, Gauge

    gauge = Gauge("surge_engine_graph_builds_total", "Engine shape buckets built (CUDA graph captures with "
                  "their kernel compilation), by phase: warmup or serving (after ready).",
                  labelnames=("model", "version", "phase"), multiprocess_mode="livesum",
                  registry=CollectorRegistry())
    shown: set[tuple[str, str]] = set()
    while True:
        now = set()
        for service in services():
            engines = list(getattr(getattr(service.worker, "engines", None), "engines", []))
            built = sum(getattr(e, "builds", 0) for e in engines)
            after = sum(getattr(e, "builds_after_ready", 0) for e in engines)
            key = (service.name, service.version)
            now.add(key)
            gauge.labels(*key, "warmup").set(built - after)
            gauge.labels(*key, "serving").set(after)
        for key in shown - now:  # an unloaded version: its counts go with it
            for phase in ("warmup", "serving"):
                try:
                    gauge.remove(*key, phase)
                except KeyError:
                    pass
        shown = now
        await asyncio.sleep(every_s)


def run_loop(coro) -> None:
    """uvloop where installed (as uvicorn does for the front ends): its loop costs about half of asyncio's per callback."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)

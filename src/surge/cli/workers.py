"""`surge serve --workers N`: N front-end processes and one engine process.

    supervisor (this module's serve_workers)
      ├── engine process: the engines, the continuous batcher (runtime/batcher.py),
      │     listening on a Unix socket (runtime/ipc.py EngineServer)
      └── front ends x N: uvicorn on one shared listening socket (the kernel spreads
            connections); HTTP parsing, validation, cache, tokenization and
            post-processing; token batches to the engine (ipc.EngineClient)

A lone client skips the hop: a front end hands a new connection to its engine process while that
one serves fewer than --engine-connections itself (server/http/handoff.py), which serves it
with its own copy of the app (cli/workers_engine.py `EngineHttp`) and hands it back when front ends keep it busy.

Why: one Python process tops out at ~30,000 trivial responses a second and
far fewer real ones, while the GPU engine runs 85,000 sequences/s; the
per-request work (HTTP, JSON, tokenizing) is what scales with processes, and
the GPU wants one process batching everybody's inputs.

Metrics and KServe statistics are whole across processes: /metrics reads every process's
prometheus_client files, a statistics request every front end's mirrored totals (runtime/stats.py).

Cache: each front end keeps its own local tiers (no lock, no hop); behind them a table in
shared memory that every front end reads and fills (runtime/shm_cache.py, sized by
--cache-bytes), and Redis stays available as the tier shared between machines.

Lifecycle: the engine process warms up (every bucket) before it listens, and
front ends report ready only once connected. A front end that crashes is
started again, and takes no connection (HTTP or gRPC) before it serves: the
others answer meanwhile (server/app.py, `serve_when_ready`). An engine process
that crashes makes every front end fail its in-flight requests with 503 at once
(EOF on the socket) and report not ready until the restarted engine is back. SIGTERM (or Ctrl-C): front ends drain
(uvicorn's graceful shutdown, requests in flight are answered), then the
engine process stops. HTTP and gRPC (both ports shared by every front end: the
HTTP socket is inherited, the gRPC port bound with SO_REUSEPORT). The supervisor itself, and why
nothing of it outlives it (a failed start, a SIGKILL): cli/workers_supervisor.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys

from surge.config import ServerConfig

log = logging.getLogger("surge")


def child_config(config: ServerConfig) -> str:
    """The settings a child process rebuilds its ServerConfig from: only the fields that were set, so
    the child still tells what the user set from a field's default (model.yaml precedence, a decoder's
    GPU precision, an artifact's measured batch size all read `model_fields_set`)."""
    return config.model_dump_json(exclude_unset=True)


CONFIG_ENV = "SURGE_CHILD_CONFIG"  # a child's settings (child_config's JSON), never on its command line
FROM_ENV = "@env"  # the argument that stands for them


def child_settings(arg: str) -> str:
    """The settings JSON a child was started with, taken out of the environment so that processes it
    starts in turn (a Python model's worker, a decoder's engine process) do not inherit the secrets."""
    return os.environ.pop(CONFIG_ENV) if arg == FROM_ENV else arg


def resolve_workers(config: ServerConfig) -> int:
    """How many front ends: --workers as given (0: one per core), or by default from the core count
    where --workers supports the mode (one embedding model, torch engine, one CUDA device: the
    front ends' HTTP, JSON and tokenizing scale with processes, the GPU wants one batcher) and the
    machine has cores to spare: three quarters of them, at most 12 (on the H200's 16 cores, with
    the load generator on the same host, 12 front ends served 16,819 req/s at 256 clients with p99
    30 ms against 16,119 and 56 ms with 8: docs/benchmarks/serving_core.md). Else 1: one process."""
    if config.workers is not None:
        return config.workers or (os.cpu_count() or 1)
    e = config.engine
    if (config.model_repository is not None or e.engine != "torch" or not e.device.startswith("cuda")
            or e.devices or e.tensor_parallel > 1):
        return 1
    cores = os.cpu_count() or 1
    if cores < 4:
        return 1
    try:
        from surge.models import bundled_model_dir, load_model_spec
        from surge.runtime.tensor_loader import kind_of_path

        model_dir = config.model_dir or bundled_model_dir()
        if (kind_of_path(model_dir) is not None
                or load_model_spec(model_dir, name=config.model_name, task=config.task).task != "embed"):
            return 1  # tensor files, task heads, decoders: one process
    except Exception:  # noqa: BLE001 - the one-process path reports a bad model directory properly
        return 1
    return min(12, cores * 3 // 4)


def serves_decoder(config: ServerConfig) -> bool:
    """A single decoder model (task generate): its engine process runs the shared engine loop
    (runtime/generate_hub.py)."""
    if config.model_repository is not None:
        return False
    from surge.models import bundled_model_dir
    from surge.models.decoder import is_decoder_dir

    return is_decoder_dir(config.model_dir or bundled_model_dir())


def engine_processes(config: ServerConfig, workers: int) -> int:
    """Engine processes under --workers: as given, else 2 with 8 or more front ends. With a
    repository each one runs it (the same directory, its own copy of every model on the device);
    repository calls from any front end reach them all (cli/workers_repo.RemoteRepository).
    A decoder has one: its KV cache and its running batch are one engine's."""
    if serves_decoder(config):
        if (config.engine_processes or 1) != 1:
            raise SystemExit("surge: a decoder model runs in one engine process (--engine-processes 1)")
        return 1
    if config.engine_processes is not None:
        return config.engine_processes
    return 2 if workers >= 8 else 1  # H200, MiniLM, 256 clients: 14,205 req/s with 2 against 11,679 with 1


def serve_workers(config: ServerConfig, workers: int) -> int:
    """Run the supervisor until SIGTERM / SIGINT; returns the exit code (cli/workers_supervisor.py)."""
    from surge.cli.workers_supervisor import serve_workers as supervise

    return supervise(config, workers)


# ---------------------------------------------------------------- a front end

class RemoteEngines:
    """What a front end's ModelWorker holds instead of engines: their capabilities."""

    def __init__(self, caps):
        self.capabilities = caps
        self.engines: list = []

    def close(self) -> None:
        pass


def front_state(config: ServerConfig, sock: str, others: list[str] = ()):
    """A front end's AppState. `others`: the other engine processes' sockets (a repository's calls
    go to all of them; requests go to `sock`'s only)."""
    from surge.engines.base import Capabilities
    from surge.models import bundled_model_dir, load_model_spec
    from surge.runtime.ipc import EngineClient
    from surge.runtime.registry import ModelRegistry
    from surge.runtime.service import ModelService
    from surge.runtime.tokenize import Tokenizer
    from surge.runtime.worker import ModelWorker, PostSpec
    from surge.server.state import AppState
    from surge.types import Layout

    state = AppState(config=config, registry=ModelRegistry())
    if config.model_repository is not None:
        _front_repository(state, config, sock, list(others))
        return _front_extras(state, config)
    spec = load_model_spec(config.model_dir or bundled_model_dir(), name=config.model_name)
    if spec.task == "generate":
        _front_decoder(state, config, spec, sock)
        return _front_extras(state, config)
    handoff = None
    if config.engine_connections > 0:  # lone connections to the engine process (server/http/handoff.py)
        try:
            from surge.server.http import frontend
        except ImportError:  # no httptools: uvicorn's own protocol, which hands nothing over
            frontend = None
        if frontend is not None:
            from surge.server.http.handoff import Handoff

            handoff = frontend.HANDOFF = Handoff(sock, config.engine_connections)

    async def connect(state: AppState) -> None:
        holder = {}

        def on_state(up: bool) -> None:
            svc = holder.get("service")
            if svc is not None:
                svc.ready = up  # not ready (503 at once) while the engine process is away
            if handoff is not None and svc is not None:  # its connections answer 503 at once too
                handoff.engine_back() if up else handoff.engine_lost()

        client = EngineClient(sock, on_state=on_state)
        client.on_return = handoff.take_back if handoff is not None else None
        hello = await client.connect()
        caps = Capabilities(hello["max_batch"], hello["max_tokens"], Layout(hello["layout"]), hello["device"],
                            hello["dtype"], hello["hidden"])
        max_len = min(config.engine.max_seq_len or spec.max_length, spec.max_length)
        tok = Tokenizer(spec.tokenizer_file, max_length=max_len, vocab_size=spec.vocab_size, pad_id=spec.pad_token_id)
        worker = ModelWorker(spec, tok, RemoteEngines(caps), PostSpec(spec.pooling, spec.normalize))
        worker.fingerprint = lambda: hello["fingerprint"]  # the engine's build (shared cache tier key)
        service = ModelService(spec.name, "1", worker, batching=config.batching, cache=config.cache,
                               limits=config.limits, batcher=client)
        holder["service"] = service
        state.registry.add(service)
        service.mark_ready()
        if handoff is not None:  # only now: until this front end serves, it hands nothing over either
            handoff.engine_back()
        print(f"surge: front end {os.getpid()} ready, serving {service.name} on http://{config.host}:{config.port}",
              file=sys.stderr, flush=True)

    state.extras.setdefault("on_startup", []).append(connect)
    return _front_extras(state, config)


def _front_decoder(state, config: ServerConfig, spec, sock: str) -> None:
    """A front end of a decoder: its GenerateService streams through the engine process's shared loop
    (runtime/generate_hub.py). No connection is handed over: that process runs no HTTP."""
    async def connect(state) -> None:
        from surge.runtime.generate_hub import HubClient
        from surge.runtime.generate_service import attach_shared_cache
        from surge.runtime.generate_load import service_over
        from surge.runtime.loader import generate_settings

        client = await asyncio.to_thread(HubClient, sock)
        _, _, gen = generate_settings(spec, config.engine, config.generation)
        service = service_over(client, spec.path, spec.name, "1", gen, config.limits.request_timeout_s)
        attach_shared_cache(service, config.cache)
        service.bind_loop(asyncio.get_running_loop())  # read the engine's reports from now on
        state.registry.add(service)
        service.mark_ready()
        print(f"surge: front end {os.getpid()} ready, serving {service.name} on http://{config.host}:{config.port}",
              file=sys.stderr, flush=True)

    state.extras.setdefault("on_startup", []).append(connect)


def _front_repository(state, config: ServerConfig, sock: str, others: list[str]) -> None:
    """A front end of a repository: its models follow the engine process's CATALOG."""
    from surge.cli.workers_repo import FrontModels, RemoteRepository, front_service
    from surge.runtime.ipc import EngineClient

    holder = {}
    client = EngineClient(sock, on_state=lambda up: holder["models"].set_ready(up),
                          on_catalog=lambda cat: holder["models"].sync(cat))
    from surge.cli.workers_generate import front_generator

    holder["models"] = FrontModels(state, client, lambda entry: front_service(config, entry, client),
                                   lambda entry: front_generator(config, entry))
    state.lifecycle = RemoteRepository(client, [EngineClient(p) for p in others])

    async def connect(state) -> None:
        await client.connect()
        await asyncio.wait_for(holder["models"].synced.wait(), 120)  # the CATALOG follows HELLO
        await holder["models"].first_attempts()  # decoders connect off the loop: listed once they serve
        names = ", ".join(f"{s.name}:{s.version}" for s in state.registry.services())
        print(f"surge: front end {os.getpid()} ready, serving {names or 'nothing'} from {config.model_repository} "
              f"on http://{config.host}:{config.port}", file=sys.stderr, flush=True)

    state.extras.setdefault("on_startup", []).append(connect)


def _front_extras(state, config: ServerConfig):
    """gRPC and whole-process metrics, for either kind of front end."""
    # Both ports are shared with front ends that serve (one restarted after a crash starts beside a
    # ready one): it accepts HTTP connections only once its models serve (server/app.py), and its
    # gRPC socket, which would take a share of the connections, listens only then.
    state.extras["serve_when_ready"] = True
    if config.grpc_port:  # gRPC (KServe v2) from every front end, on one shared port
        from surge.server.grpc.server import install_grpc

        install_grpc(state, reuse_port=True, after_models=True)
    return whole_metrics(state, config)


def whole_metrics(state, config: ServerConfig):
    """/metrics of every process (front ends, engine processes) from prometheus_client's files."""
    from surge.runtime.metrics import WholeRegistry, default_registry, families, multiprocess_dir

    gpu = None
    if config.engine.device.startswith("cuda"):
        from surge.engines.gpu_metrics import register_gpu_metrics

        gpu = register_gpu_metrics(CollectorRegistryStub())
    if multiprocess_dir():
        fam = families(default_registry())
        state.extras["metrics_registry"] = WholeRegistry(multiprocess_dir(), [gpu, fam.devices])
    return state


class CollectorRegistryStub:
    """Takes the GPU collector without exporting it twice (WholeRegistry exports it)."""

    def register(self, collector) -> None:
        pass


def front_main(config_json: str, sock: str, fd: str, all_socks: str = "") -> None:
    # N front ends on one host: each tokenizes inline, one short request at a time; tokenizers'
    # own thread pool (a thread per core in every process) would only contend with the others.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import uvicorn

    from surge.server.app import create_app

    config = ServerConfig.model_validate_json(config_json)
    others = [p for p in all_socks.split(",") if p and p != sock]
    state = front_state(config, sock, others)
    app = create_app(state)
    # The inherited TCP socket, with its real family: uvicorn's own `fd=` wraps it as AF_UNIX, and
    # asyncio then leaves Nagle on for accepted connections (TCP_NODELAY is set for INET sockets
    # only): every response waited ~40 ms for the client's delayed ACK.
    listener = socket.socket(fileno=int(fd))
    extra = {}
    try:  # fewer layers and one send per response (server/http/frontend.py)
        from surge.server.http.frontend import CorkedHttpToolsProtocol, FrontDoor

        app, extra = FrontDoor(app), {"http": CorkedHttpToolsProtocol}
    except ImportError:  # no httptools: uvicorn's own choice
        pass
    server = _front_server_class()(state, uvicorn.Config(app, log_level=config.log_level, access_log=False,
                                                         timeout_graceful_shutdown=10, **extra))
    server.run(sockets=[listener])


def _front_server_class():
    import uvicorn

    class FrontServer(uvicorn.Server):
        """uvicorn's server, but SIGTERM / SIGINT also end a start that is still waiting (its engine
        process away): the app takes no connection before it serves (server/app.py), and uvicorn
        would otherwise wait for that start to finish before it looks at the signal."""

        def __init__(self, state, config):
            super().__init__(config)
            self.surge_state = state

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            task = self.surge_state.extras.get("startup_task")
            if not self.started and task is not None and not task.done():
                task.get_loop().call_soon_threadsafe(task.cancel)  # from a signal handler: wake the loop

    return FrontServer


if __name__ == "__main__":
    role, config_arg, *rest = sys.argv[1:]
    rest = [child_settings(config_arg), *rest]
    if role == "engine":
        from surge.cli.workers_engine import engine_main
        from surge.errors import SurgeError

        try:
            engine_main(*rest)
        except SurgeError as exc:  # a model or setting the user can fix: its message, not a traceback
            print(f"surge: {exc.message}", file=sys.stderr, flush=True)
            sys.exit(1)
    elif role == "front":
        front_main(*rest)
    else:
        raise SystemExit(f"unknown role {role!r}")

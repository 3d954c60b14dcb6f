"""The standard gRPC health service (grpc.health.v1.Health) and server reflection.

Kubernetes gRPC probes, grpc_health_probe and grpcurl speak these, not KServe's
ServerLive / ServerReady. Service names answered:

- "" and "inference.GRPCInferenceService": the server, SERVING when /ready would
  answer 200 (startup done, every model warm);
- each model's name and alias: SERVING while its newest version is loaded and
  ready, NOT_SERVING while it is loading or unloaded; an unknown name is NOT_FOUND
  for Check and SERVICE_UNKNOWN for Watch (as the health protocol says).

Watch follows readiness without polling: the model registry and the end of
startup notify the servicer, which wakes every watcher to re-read its status.

List (added to grpc.health.v1 in grpcio-health-checking 1.7x; answered where the
installed package defines it) gives every name above with its status. It names the
served models, so unlike Check and Watch it needs the API key when one is set.
"""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc

from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.state import AppState

Status = health_pb2.HealthCheckResponse.ServingStatus
SERVER_NAMES = ("", "inference.GRPCInferenceService")
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
# Health RPCs answer without the API key (as the HTTP health routes do).
OPEN_METHODS = frozenset({f"/{HEALTH_SERVICE}/Check", f"/{HEALTH_SERVICE}/Watch"})


class HealthServicer(health_pb2_grpc.HealthServicer):
    def __init__(self, state: AppState):
        self.state = state
        self._changed = asyncio.Event()
        self._seen: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        state.registry.subscribe(self.notify)
        state.extras.setdefault("on_started", []).append(lambda _state: self.notify())

    def notify(self) -> None:
        """Something about readiness changed: wake the watchers (from any thread)."""
        loop = self._loop
        if loop is not None and not _in_loop(loop):
            loop.call_soon_threadsafe(self.notify)
            return
        self._seen.update(self.state.registry.names())
        self._seen.update(self.state.registry.aliases())
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def status(self, service: str) -> int:
        state = self.state
        if service in SERVER_NAMES:
            return Status.SERVING if state.ready else Status.NOT_SERVING
        registry = state.registry
        name = registry.resolve(service)
        if name in registry.names():
            return Status.SERVING if registry.get(name).ready else Status.NOT_SERVING
        if service in self._seen or name in self._seen or self._known(name):
            return Status.NOT_SERVING
        return Status.SERVICE_UNKNOWN

    def _known(self, name: str) -> bool:
        """A model the server will serve but has not loaded (yet, or any more)."""
        life = self.state.lifecycle
        try:
            if hasattr(life, "model_names"):  # the model repository
                return name in life.model_names()
            return getattr(life, "name", None) == name  # one model directory
        except Exception:  # noqa: BLE001 - an unreadable repository: the name is unknown
            return False

    async def Check(self, request, context):
        status = self.status(request.service)
        if status == Status.SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service '{request.service}'")
        return health_pb2.HealthCheckResponse(status=status)

    def names(self) -> list[str]:
        """Every service name the server answers for now: the server's, and each model's and alias'."""
        registry = self.state.registry
        return sorted({*SERVER_NAMES, *self._seen, *registry.names(), *registry.aliases()})

    if hasattr(health_pb2, "HealthListResponse"):
        async def List(self, request, context):
            return health_pb2.HealthListResponse(statuses={
                name: health_pb2.HealthCheckResponse(status=self.status(name)) for name in self.names()})

    async def Watch(self, request, context):
        self._loop = asyncio.get_running_loop()
        last = None
        while True:
            changed = self._changed
            status = self.status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await changed.wait()


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """One pool with every served service's file: the KServe stubs live in a private pool
    (see scripts/gen_grpc.sh), so the default pool cannot describe them."""
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.DescriptorPool()
    for file in (pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        pool.AddSerializedFile(file.serialized_pb)
    return pool


def add_health_and_reflection(server: grpc.aio.Server, state: AppState) -> HealthServicer:
    from grpc_reflection.v1alpha import reflection

    servicer = HealthServicer(state)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = [pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name, HEALTH_SERVICE,
             reflection.SERVICE_NAME]
    reflection.enable_server_reflection(names, server, pool=reflection_pool())
    return servicer

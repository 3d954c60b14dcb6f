"""Starting and stopping the gRPC server next to HTTP, in the same process and
event loop (grpc.aio), from the app's startup and shutdown hooks.

What a client can hold is bounded as on the HTTP port (server/http/conn_guard.py), by grpcio's own
channel arguments (checked against grpcio 1.85 by tests/e2e/test_grpc_limits.py and test_grpc_slow_readers.py):

- `--request-read-timeout-s`: a connection that has not finished its HTTP/2 handshake
  (`grpc.server_handshake_timeout_ms`) or that has had no call in flight (`grpc.max_connection_idle_ms`)
  for that long is closed, with a GOAWAY after a handshake; a client reconnects at its next call. By
  default grpcio closed only a connection that never acknowledged its SETTINGS, after 60 s; one that did
  and started no call was held for ever. And a call whose one request message (a request stream may wait) has not
  arrived whole that long after the call started is ended, DEADLINE_EXCEEDED (its stream then reset), which
  frees its slot of `--grpc-max-concurrent-rpcs`: no channel argument bounds that read, which grpc.aio
  does before any handler runs, so an interceptor does it (read_deadline.py). Before, a client that sent a
  call's HEADERS and never its DATA held a slot until its connection went, and one that half-closed a
  unary call without a message got no answer at all (now INTERNAL at once).
- `--max-connections`: `grpc.max_allowed_incoming_connections`, unbounded by default; one more is closed
  as soon as it is accepted, before anything is read from it (the client sees UNAVAILABLE).
- `--grpc-max-concurrent-rpcs`: grpc.aio's `maximum_concurrent_rpcs`; one more call gets
  RESOURCE_EXHAUSTED at once instead of a coroutine and its request message in memory.
- `--max-header-bytes`: the call's metadata, as both the soft and the hard limit
  (`grpc.max_metadata_size`, `grpc.absolute_max_metadata_size`: between them grpcio refuses at random);
  more gets RESOURCE_EXHAUSTED.
- `--send-timeout-s`: a call whose answer waits to be sent (a unary answer, a stream's response, its status) while its
  connection's client acknowledges none of what the server sent for that long has its connection reset, which ends
  the calls on it and frees their slots of `--grpc-max-concurrent-rpcs` (send_deadline.py). Before, a client that read
  its socket but granted no HTTP/2 window (a grpcio client that opens ModelStreamInfer and never reads the responses
  does so) held the call, its slot and its answer's memory (up to 2048 inputs' tensors) for ever: grpc core has no
  send timeout, and grpc.aio gives a servicer no way to end a call whose answer core is writing (a write given up
  with asyncio.wait_for stays in core, the status waits behind it, and the call holds its slot until core ends it).
  A client that stops reading its socket instead was already cut by grpc core: it sets TCP_USER_TIMEOUT (its
  keepalive timeout, `--grpc-keepalive-timeout-s`: `grpc.keepalive_timeout_ms`, 20 s as grpc core's default) on
  the connections it accepts, and Linux ends one whose window stays shut that long.
- `--grpc-max-connection-age-s` (off by default: it cuts long streams): `grpc.max_connection_age_ms`, with
  `--request-timeout-s` as `grpc.max_connection_age_grace_ms` (unbounded by default, so that without it
  a call could outlive its connection's age for ever). It bounds what the read deadline leaves: request
  streams (ModelStreamInfer), which may wait for their first message as between any two.

Keepalive is left to grpcio's defaults, which already refuse ping floods: while no data flows, pings
closer together than `grpc.http2.min_recv_ping_interval_without_data_ms` (5 min) are strikes, and after
`grpc.http2.max_ping_strikes` (2) the connection gets GOAWAY.
"""

from __future__ import annotations

import hmac
import logging
import sys

import grpc

from surge.errors import ConfigError
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from surge.server.grpc.health import OPEN_METHODS as HEALTH_METHODS, add_health_and_reflection
from surge.server.grpc.read_deadline import ReadDeadlineInterceptor
from surge.server.grpc.send_deadline import SendDeadlineInterceptor
from surge.server.grpc.servicer import InferenceServicer
from surge.server.http.conn_guard import connection_limit, limited_ports
from surge.server.state import AppState

log = logging.getLogger("surge.server")

# RPCs that skip the API key check, as the HTTP health routes do.
OPEN_METHODS = frozenset({"ServerLive", "ServerReady"})
# Responses can be much larger than requests (many inputs x dims x 4 bytes).
MAX_SEND_BYTES = 512 * 1024 * 1024


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Requires metadata 'authorization: Bearer KEY' (the HTTP header's twin)."""

    def __init__(self, api_key: str):
        self._expected = f"Bearer {api_key}".encode()

        async def deny(request_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key (send metadata 'authorization: Bearer <key>')")

        # A request-streaming handler, whatever the method: it answers without reading the request, where
        # a unary one had gRPC read and assemble each message (up to the size limit) first, so that
        # clients without the key could make the server hold ~2 MB per call in flight.
        self._deny = grpc.stream_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        if details.method in HEALTH_METHODS or details.method.rsplit("/", 1)[-1] in OPEN_METHODS:
            return await continuation(details)
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._expected):
            return await continuation(details)
        return self._deny


def max_age_options(limits) -> list[tuple[str, int]]:
    if limits.grpc_max_connection_age_s is None:
        return []
    return [("grpc.max_connection_age_ms", max(1, round(limits.grpc_max_connection_age_s * 1000))),
            ("grpc.max_connection_age_grace_ms", max(1, round(limits.request_timeout_s * 1000)))]


def build_server(state: AppState, reuse_port: bool = False) -> tuple[grpc.aio.Server, str]:
    """reuse_port: the front ends of --workers share one port (the supervisor holds it, cli/workers.py)."""
    config = state.config
    limits = config.limits
    # The API key first: a call without it is answered before anything of its request is read, and only then
    # the read deadline, so that a refused call is not turned into one that reads its message.
    interceptors = [ApiKeyInterceptor(config.api_key)] if config.api_key else []
    interceptors.append(ReadDeadlineInterceptor(limits.request_read_timeout_s))
    # Last: it wraps the servicer's own handlers (the read deadline then wraps what it gives).
    interceptors.append(SendDeadlineInterceptor(limits.send_timeout_s, config.grpc_port))
    read_timeout_ms = max(1, round(limits.request_read_timeout_s * 1000))
    server = grpc.aio.server(
        interceptors=interceptors,
        maximum_concurrent_rpcs=limits.grpc_max_concurrent_rpcs,
        options=[
            # The same bound as an HTTP body: a larger request gets RESOURCE_EXHAUSTED.
            ("grpc.max_receive_message_length", limits.max_body_bytes),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            # A second server on a taken port must fail, not share it (unless it is meant to).
            ("grpc.so_reuseport", 1 if reuse_port else 0),
            # What a client can hold without a call (the module's docstring).
            ("grpc.server_handshake_timeout_ms", read_timeout_ms),
            ("grpc.max_connection_idle_ms", read_timeout_ms),
            ("grpc.max_allowed_incoming_connections", connection_limit(limits.max_connections, limited_ports(config))),
            # A client whose TCP window stays shut (it reads nothing) is cut by the kernel (the module's docstring).
            ("grpc.keepalive_timeout_ms", max(1, round(limits.grpc_keepalive_timeout_s * 1000))),
            ("grpc.max_metadata_size", limits.max_header_bytes),
            ("grpc.absolute_max_metadata_size", limits.max_header_bytes),
            *max_age_options(limits),
        ],
    )
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(state), server)
    add_health_and_reflection(server, state)  # grpc.health.v1.Health, server reflection
    address = f"[{config.host}]:{config.grpc_port}" if ":" in config.host else f"{config.host}:{config.grpc_port}"
    try:  # grpcio raises (RuntimeError) where older releases returned port 0
        bound = server.add_insecure_port(address)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ConfigError(f"cannot listen on {address} for gRPC (--grpc-port {config.grpc_port}): the port is in "
                          "use or not allowed; pick another --grpc-port, or --grpc-port 0 to serve without gRPC",
                          param="grpc_port")
    return server, address


def install_grpc(state: AppState, reuse_port: bool = False, after_models: bool = False) -> None:
    """Register startup/shutdown hooks that run the gRPC server with the app. `after_models`: it
    listens only once the models serve (a --workers front end: its SO_REUSEPORT socket would take
    a share of the connections while it cannot answer them), not first."""

    async def start(state: AppState) -> None:
        server, address = build_server(state, reuse_port)
        await server.start()
        state.extras["grpc_server"] = server
        log.info("gRPC (KServe v2) listening on %s", address)
        print(f"surge: gRPC (KServe v2) on {address}", file=sys.stderr, flush=True)

    async def stop(state: AppState) -> None:
        server = state.extras.pop("grpc_server", None)
        if server is not None:
            await server.stop(grace=5)

    hooks = state.extras.setdefault("on_startup", [])
    if after_models:
        hooks.append(start)
    else:  # first, so that ServerLive answers while the models load
        hooks.insert(0, start)
    state.extras.setdefault("on_shutdown", []).append(stop)

"""A send deadline on the gRPC port (`--send-timeout-s`, nginx's send_timeout; the HTTP port's is
server/http/conn_guard.SendDeadline): a call whose answer waits to be sent (a unary answer, a stream's response, the
final status) while its connection's client takes nothing of what the server sent for that long has its connection
cut, which ends every call on it and frees their slots of `--grpc-max-concurrent-rpcs`.

Why: grpc.aio hands an answer to grpc core and waits until core has written it; a client that never lets it be
written (never reads its socket, or reads it but never grants HTTP/2 flow-control window: a grpcio client that opens
ModelStreamInfer and does not read the responses does the latter) held the call, its slot, the answer's memory (up
to 2048 inputs' tensors) and its connection for ever: grpc core has no send timeout, keepalive pings are answered by
a client that reads its socket, and grpc.aio offers a servicer no way to end a call whose answer core is writing
(a write given up with asyncio.wait_for stays in core, and the status waits behind it). The connection's socket is
the one handle left (server/grpc/peer_sockets.py).

What is timed: from a unary handler's return, and from each response a stream handler yields, until grpc.aio has
written it (the stream's generator is resumed, or, for the last answer and the status, the call is done). A call
whose answer has waited a quarter of the timeout is looked at every quarter: the bytes its connection's client has
acknowledged (TCP_INFO); each look that finds more restarts the clock, so a client that reads, however slowly, is
never cut; one that took none for the timeout is cut, between 1 and 1.5 times the timeout after it last took any
(where the system does not give the bytes acknowledged: that long after the first look). Progress is the
connection's: a client that keeps reading other calls on the same connection keeps a stalled one
(`--grpc-max-connection-age-s` bounds that). A cut ends the other calls on the connection too (UNAVAILABLE for
the client's), as the HTTP port's does the connection's next requests.

What is counted: a unary call's request counts answered (its latency observed, its KServe statistics recorded) only
once the call is done, its answer written; one cut with its answer unwritten counts once, as its client's leaving
("cancelled"), as the HTTP port's cut answer does (server/http/delivery.py), never as answered too. The handler's
task awaits a Delivery (runtime/outcome.py) that the runtime hands what to count when it answers; the call's done
callback settles it delivered, a cut settles it "cancelled" first. grpc.aio tells a handler nothing of how the
writing of its answer ended (a failed final write is dropped silently, and ServicerContext.cancelled() is only what
the handler set itself): the cut is what is known to lose an answer, and an answer lost otherwise once handed over
(its client cancelled the call while it was written) still counts answered. ModelStreamInfer settles each
request's delivery itself, when grpc.aio has written its last response or the stream ends without it (extras.py).

Lazy, as the read deadline: an answer written at once (nearly all) costs a Delivery, three dict operations and a done
callback; one timer serves every call; the descriptors are scanned only for calls whose answers have waited a quarter
of the timeout, all of them in one pass.
"""

from __future__ import annotations

import asyncio
import inspect
import logging

import grpc

from surge.runtime.outcome import CANCELLED, Delivery, awaiting, stop_awaiting
from surge.server.grpc import peer_sockets
from surge.server.grpc.wrapping import WrappingInterceptor
from surge.server.tcp_info import bytes_acked

log = logging.getLogger("surge.server")

_MAKE = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
         (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


class _Look:
    """A call looked at: its connection (peer, and descriptor once found), its client's bytes acknowledged at the
    last look, and since when they have not grown."""

    __slots__ = ("acked", "fd", "peer", "quiet_since")

    def __init__(self, peer, now: float):
        self.peer, self.fd, self.acked, self.quiet_since = peer, None, None, now


class SendDeadlineInterceptor(WrappingInterceptor):
    """Times the sending of every async handler's answers (module docstring). `port`: the gRPC port, whose accepted
    connections hold the calls."""

    def __init__(self, timeout_s: float, port: int):
        super().__init__()
        self.timeout_s, self.port = timeout_s, port
        self._every = timeout_s / 4
        # The calls whose answer waits, each with when it began to, oldest first, until a look is due...
        self._waiting: dict[object, float] = {}
        # ...then looked at every quarter of the timeout.
        self._looked: dict[object, _Look] = {}
        # The unary calls whose answer's delivery something counts on, until they are done or cut.
        self._delivering: dict[object, Delivery] = {}
        self._timer: asyncio.TimerHandle | None = None

    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        arm, disarm, until_done = self._arm, self._disarm, self._until_done
        if handler.response_streaming:
            behaviour = handler.unary_stream or handler.stream_stream
            if not inspect.isasyncgenfunction(behaviour):
                return handler

            async def wrapped(request, context):
                context.add_done_callback(disarm)  # a cut stream's generator may be left unfinished
                async for response in behaviour(request, context):
                    arm(context)
                    yield response  # grpc.aio writes it, then asks for the next: resumed once it is written
                    disarm(context)
                arm(context)  # the status, after the last response
        else:
            behaviour = handler.unary_unary or handler.stream_unary
            if not inspect.iscoroutinefunction(behaviour):
                return handler

            async def wrapped(request, context):
                delivery = Delivery()
                token = awaiting(delivery)  # what the runtime counts answered waits for the answer's delivery
                try:
                    response = await behaviour(request, context)
                except Exception:  # an error answered: counted as it was (its failure counted where it arose)
                    delivery.settle(None)
                    raise
                except BaseException:  # the client left (or the server stops) before the answer was handed over
                    delivery.settle(CANCELLED)
                    raise
                finally:
                    stop_awaiting(token)
                until_done(context, delivery)
                return response

        return _MAKE[handler.request_streaming, handler.response_streaming](
            wrapped, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)

    def _until_done(self, context, delivery: Delivery) -> None:
        """The unary answer is handed to grpc.aio: timed until the call is done, and delivered then."""
        self._arm(context)
        if delivery.pending:
            self._delivering[context] = delivery
        context.add_done_callback(self._done)

    def _done(self, context) -> None:
        self._disarm(context)
        if self._delivering:
            delivery = self._delivering.pop(context, None)
            if delivery is not None:
                delivery.settle(None)

    def _arm(self, context) -> None:
        self._waiting[context] = now = asyncio.get_running_loop().time()
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_at(now + self._every, self._sweep)

    def _disarm(self, context) -> None:
        # Also grpc.aio's done callback: it runs before grpc.aio releases the call, so that no look asks a
        # released call for its peer.
        self._waiting.pop(context, None)
        self._looked.pop(context, None)

    def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = [context for context, since in _until_late(self._waiting, now - self._every)]
        for context in due:  # their answers have waited a quarter of the timeout: looked at from now on
            del self._waiting[context]
            self._looked[context] = _Look(peer_sockets.peer_of(context.peer()), now)
        if self._looked:
            self._look(now)
        if self._looked:
            self._timer = loop.call_later(self._every, self._sweep)
        elif self._waiting:
            self._timer = loop.call_at(next(iter(self._waiting.values())) + self._every, self._sweep)
        else:
            self._timer = None

    def _look(self, now: float) -> None:
        looked, port = self._looked, self.port
        unknown = {look.peer for look in looked.values() if look.fd is None and look.peer is not None}
        found = peer_sockets.locate(unknown, port) if unknown else {}
        for context, look in list(looked.items()):
            if context not in looked:  # cut with another call on its connection, in this pass
                continue
            if look.fd is None:
                look.fd = found.get(look.peer)
            if look.fd is None:  # not a TCP connection of this port's, or gone: nothing to time or to cut
                del looked[context]
                continue
            with peer_sockets.connection(look.fd, look.peer, port) as sock:
                if sock is None:  # the connection is gone (its descriptor closed or reused): so is the call
                    del looked[context]
                    continue
                acked = bytes_acked(sock)
                if acked is not None and acked != look.acked:  # the client took something: its clock restarts
                    look.acked, look.quiet_since = acked, now
                elif now - look.quiet_since >= self.timeout_s:
                    log.warning("gRPC: the client %s took nothing of its answer for --send-timeout-s (%g s): its "
                                "connection is cut", context.peer(), self.timeout_s)
                    peer_sockets.reset(sock)
                    self._cut(look.peer)


    def _cut(self, peer) -> None:
        """`peer`'s connection is cut: every call on it whose answer waited is cut with its answer unwritten, its
        request counted "cancelled" (calls still computing theirs are cancelled by grpc core, and count as a
        client's leaving where they are; a stream's responses are extras.py's)."""
        for context, look in list(self._looked.items()):
            if look.peer == peer:
                del self._looked[context]
                self._lost(context)
        for context in [c for c in self._waiting if peer_sockets.peer_of(c.peer()) == peer]:
            del self._waiting[context]
            self._lost(context)

    def _lost(self, context) -> None:
        delivery = self._delivering.pop(context, None)
        if delivery is not None:
            delivery.settle(CANCELLED)


def _until_late(waiting: dict, late: float):
    """The (call, since) of `waiting` that began at or before `late` (oldest first: stops at the first later)."""
    for context, since in waiting.items():
        if since > late:
            return
        yield context, since

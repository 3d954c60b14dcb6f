"""A read deadline on each unary-request gRPC call: its message must arrive whole within
`--request-read-timeout-s` of the call's start, else the call ends DEADLINE_EXCEEDED and frees its slot of
`--grpc-max-concurrent-rpcs`.

Why here: grpc.aio reads a unary call's message itself, before any servicer code runs, and nothing in grpcio
bounds that read (no channel argument does: the connection's idle and age timers do not count a call in
flight as idle, and a deadline is the client's to set), so a client that sends a call's HEADERS and never its
DATA held the slot until its connection went, and one that half-closed without a message got no answer at
all. The interceptor gives each unary-request method grpc.aio's request-streaming handler instead, whose
behaviour (ours) reads the message itself, under a timer, and then calls the method's own behaviour with it (a
half-close without one: INTERNAL, as gRPC's own "error parsing request" is).

Request streams (ModelStreamInfer, server reflection) are left as they are: a stream may rightly wait before its
first message as between any two (Triton's client opens the stream at start_stream() and sends when the
application has a request), and bounding only the first would not bound a client that sends one message and
then waits; `--grpc-max-connection-age-s` bounds those.

A late call is aborted from a task of its own rather than by cancelling its read: grpc core's receive stays
pending until the call ends, and the read then returns into the aborted call (AbortError, as any aborted
handler's), so nothing grpc.aio started is left half done. One timer serves every call (at the oldest waiting
call's deadline), so that a call that is not late costs two dict operations; what is left of the cost is
grpc.aio's request-streaming path itself (benchmarks/grpc_read_deadline.py).

Only async behaviours are wrapped (all of surge's, health's and reflection's are); a sync one would run in
grpc's thread pool, where this timer cannot reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect

import grpc
from grpc.aio import EOF

from surge.server.grpc.wrapping import WrappingInterceptor

# Strong references to the aborting tasks while they run (the event loop keeps only weak ones).
_aborting: set[asyncio.Task] = set()


class ReadDeadlineInterceptor(WrappingInterceptor):
    """Bounds the wait for each call's first request message (module docstring)."""

    def __init__(self, timeout_s: float):
        super().__init__()
        self.timeout_s = timeout_s
        self._message = (f"the request message did not arrive within --request-read-timeout-s "
                         f"({timeout_s:g} s) of the call's start")
        # The calls waiting for their first message, each with its deadline, oldest first; one timer for all of
        # them (at the oldest's deadline): two dict operations a call, where a call_later and its cancel cost
        # ~10 times that.
        self._pending: dict[object, float] = {}
        self._sweep: asyncio.TimerHandle | None = None

    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        read_first = self._read_first
        if handler.request_streaming:  # a stream may wait before its first message (module docstring)
            return handler
        streaming_response = handler.response_streaming
        behaviour = handler.unary_stream or handler.unary_unary
        if not (inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)):
            return handler

        if inspect.isasyncgenfunction(behaviour):
            # Writes the responses itself, as grpc.aio would (its write checks that the call still runs), rather
            # than re-yielding them: no generator layer more for each response.
            async def wrapped(requests, context):
                request = await read_first(context)
                async for response in behaviour(request, context):
                    await context.write(response)
        else:
            async def wrapped(requests, context):
                return await behaviour(await read_first(context), context)

        make = grpc.stream_stream_rpc_method_handler if streaming_response else grpc.stream_unary_rpc_method_handler
        return make(wrapped, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    async def _read_first(self, context):
        """The call's request message, read under the deadline (the client half-closed without one: INTERNAL)."""
        pending = self._pending
        pending[context] = (loop := asyncio.get_running_loop()).time() + self.timeout_s
        if self._sweep is None:
            self._sweep = loop.call_at(pending[context], self._expire)
        try:
            first = await context.read()
        finally:
            pending.pop(context, None)
        if first is EOF:
            await context.abort(grpc.StatusCode.INTERNAL, "the call was half-closed without its request message")
        return first

    def _expire(self) -> None:
        """Abort every call past its deadline, then wait for the oldest left. Every call has the same timeout, so
        the calls are in deadline order: the sweep stops at the first one still in time."""
        pending, loop = self._pending, asyncio.get_running_loop()
        now, late = loop.time(), []
        for context, deadline in pending.items():
            if deadline > now:
                self._sweep = loop.call_at(deadline, self._expire)
                break
            late.append(context)
        else:
            self._sweep = None
        for context in late:
            del pending[context]
            if not context.done():
                task = loop.create_task(_abort(context, self._message))
                _aborting.add(task)
                task.add_done_callback(_aborting.discard)


async def _abort(context, message: str) -> None:
    # AbortError is how abort returns (the call's own task gets it too, from its read); a call that the client
    # closed meanwhile refuses the status (ExecuteBatchError): either way the call has ended.
    with contextlib.suppress(Exception):
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)

"""Generations counted answered once their answers are delivered, not once computed.

A generation of an HTTP route (the OpenAI completions and chat, the Responses API, Anthropic's Messages, KServe
generate and generate_stream; streamed or not) counts answered (its latency observed, its KServe statistics
recorded: server/http/generate_common.counted, counted_stream) once the kernel has taken the last byte of the
response that carries it, and as a failure "cancelled" where the connection is lost before that, as a client
that left while its answer was computed counts. Before, it counted answered as soon as its result came (a JSON
answer, written whole at the end) or its last delta was pulled from the engine (a stream): a client that stopped
reading and was cut by the send deadline (--send-timeout-s: server/http/conn_guard.py) with the answer's tail
still in the server's buffers counted answered, though it never got it.

"Taken by the kernel" is what the send deadline goes by: it cuts only a connection whose transport still holds
bytes (conn_guard.SendDeadline), so an answer wholly in the kernel is never cut by it. The protocol says when
that is (server/http/frontend.DisconnectWatch.when_sent: at once for nearly every answer, whose last write the
kernel takes whole). Without it (uvicorn's own protocol) an answer counts delivered once its last `send`
returns, as before.

POST /embed_all's held answer (server/http/held_answer.py) is counted the same way, by its own means: its
admission slot and its count wait for the same word from the protocol.

The route's answer and the generations it counts meet through a context variable: `delivered` (around the
route, server/http/hotpath.OuterHotPath) sets it for the request's task (and the tasks it starts), and each
generation that ends hands `on_delivery` what to count. Elsewhere (work that outlives its request: `unwatched`)
there is none, and a generation counts when it ends; on the gRPC port, once its call has written it
(runtime/outcome.when_delivered, server/grpc/send_deadline.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

from surge.runtime.outcome import CANCELLED, Delivery

_CURRENT: ContextVar[Delivery | None] = ContextVar("surge_delivery", default=None)


def on_delivery(callback: Callable[[str | None], None]) -> bool:
    """Have `callback(code)` run once the response of the request being served is delivered (code None) or
    not (its failure code). False where no response is watched (`callback` not kept): count now."""
    d = _CURRENT.get()
    if d is None:
        return False
    d.then(callback)
    return True


def unwatched() -> None:
    """The current task's generations count when they end: work that outlives its request (a background
    response) is not its request's answer."""
    _CURRENT.set(None)


async def delivered(scope, receive, send, app) -> None:
    """Run ASGI `app`, the generations it counts settled by its response's delivery: the last body message
    sent and, where the protocol says (the `surge.disconnect` extension), its bytes taken by the kernel."""
    watch = scope.get("extensions", {}).get("surge.disconnect")
    when_sent = getattr(watch, "when_sent", None)
    d = Delivery()
    token = _CURRENT.set(d)
    handed = False

    def sent(ok: bool) -> None:
        d.settle(None if ok else CANCELLED)

    async def tracked(message) -> None:
        nonlocal handed
        await send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False) and not handed:
            handed = True  # uvicorn's send returns silently on a lost connection: when_sent tells
            if when_sent is None:
                d.settle(None)
            else:
                when_sent(sent)

    try:
        await app(scope, receive, tracked)
    except Exception:
        if not handed:  # uvicorn answers 500 itself
            d.settle("internal_error")
        raise
    except BaseException:
        if not handed:
            d.settle(CANCELLED)
        raise
    finally:
        _CURRENT.reset(token)
    if not handed:  # the hot path's handler cancelled by the connection's loss, or no answer at all
        d.settle(CANCELLED)

"""HTTP answers counted answered once they are delivered, not once computed: counted at write time.

A request of the HTTP port (an embedding, task, tensor or KServe infer answer, POST /embed_all, a generation of the
OpenAI completions and chat, the Responses API, Anthropic's Messages, KServe generate and generate_stream; streamed
or not; answered by a route, a hot path or the direct path of server/http/direct.py) counts answered (its latency
observed: runtime/outcome.answered; its KServe statistics recorded: server/state.AppState.call,
generate_common.counted, counted_stream) once the kernel has taken the last byte of the response that carries it,
and as a failure "cancelled" where the connection is lost before that, as a client that left while its answer
was computed counts. Before, it counted answered as soon as its answer was computed: a client that stopped reading
and was cut by the send deadline (--send-timeout-s: server/http/conn_guard.py) with the answer's tail still in the
server's buffers counted answered, though it never got it.

"Taken by the kernel" is what the send deadline goes by: it cuts only a connection whose transport still holds
bytes (conn_guard.SendDeadline), so an answer wholly in the kernel is never cut by it.

Counted at WRITE time, so that the common case costs nothing: the request's task awaits a runtime/outcome.AtWrite
(`awaiting`), which holds the runtime's counts in its own slots; once the answer's last byte is written (the
corked transport flushed), `AtWrite.written` asks the transport whether bytes still wait in it
(DisconnectWatch.unsent). Nearly always none do: it counts at once, with no future or callback made (the KServe
record, as before, right after the loop pass: recorded inside it, the front end spent 3-5% more CPU a request).
Else it waits for the protocol's word (DisconnectWatch.when_sent: the buffer drained, or the connection lost
first). The direct path's per-request object is the AtWrite itself (direct.HotCycle); the ASGI path (`delivered`,
around every POST: server/http/hotpath.OuterHotPath) makes one per request. Without the protocol's watch (uvicorn's
own protocol) an answer counts delivered once its last `send` returns.

POST /embed_all's held answer (server/http/held_answer.py) frees its admission slot by the same word; its KServe
statistics wait here like every answer's.
"""

from __future__ import annotations

from surge.runtime.outcome import CANCELLED, AtWrite, awaiting, stop_awaiting


def unwatched() -> None:
    """The current task's answers count when they are handed over: work that outlives its request (a background
    response) is not its request's answer. For a task's own context (not reset)."""
    awaiting(None)


async def delivered(scope, receive, send, app) -> None:
    """Run ASGI `app`, what it counts answered settled by its response's delivery: the last body message sent and,
    where the protocol says (the `surge.disconnect` extension), its bytes taken by the kernel."""
    watch = scope.get("extensions", {}).get("surge.disconnect")
    d = AtWrite()
    token = awaiting(d)
    handed = False

    async def tracked(message) -> None:
        nonlocal handed
        await send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False) and not handed:
            handed = True  # uvicorn's send returns silently on a lost connection: the watch tells
            d.written(watch)

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
        stop_awaiting(token)
    if not handed:  # the hot path's handler cancelled by the connection's loss, or no answer at all
        d.settle(CANCELLED)

"""A JSON answer whose bytes stay under admission control until the kernel has taken them all.

A Response renders its whole body and uvicorn hands it to the transport in one write, which buffers all of
it for as long as the client takes to read: nothing bounds what slow readers hold. POST /embed_all's
answers are large (every token's hidden state, ~3x the float rows as JSON), so its route answers with
this one instead: the body is rendered while the request's admission slot is still held, then sent in
pieces, and uvicorn's `send` takes a piece only once the transport's buffer has drained below its high
water mark (its flow control), i.e. as the client reads. `release` (the slot, and the request's count) runs
once the kernel has taken the answer's last byte, or the sending ends otherwise (the client gone, the task
cancelled): the memory held for answers not yet read is then bounded by admission, and past the bound the
next request is a 429.

"Taken by the kernel", not "handed to `send`": after the last piece was handed over the transport may still
hold up to about a piece of it (the client's window full), and a client that reads no more is then cut by the
connection's send deadline (--send-timeout-s: server/http/conn_guard.py, which cuts only a connection whose
transport still holds bytes). The protocol says when the transport's buffer is empty, or that the connection
was lost first (server/http/frontend.DisconnectWatch.when_sent, as server/http/delivery.py uses it for every
HTTP answer, whose KServe statistics wait for the same word). Before, the answer counted answered as soon as its
last piece was handed to `send`, though it never reached its client, and its KServe statistics a success as soon as
it was computed. Without the protocol's word (uvicorn's own protocol) it counts once its last `send` returns.

A client that stops reading earlier is cut the same way: the connection is lost, uvicorn's `send` returns
without waiting and drops what it is given, and the answer stops there. Such an answer, or one whose sending
failed, is not one answered: `release` gets the error (Cancelled for a client gone before its last byte was
taken), so that the request counts as a failure under its code, as one whose client left while it was
computed does.
"""

from __future__ import annotations

import asyncio

from surge.errors import Cancelled
from surge.server.http.common import ORJSONResponse

PIECE = 256 * 1024  # bytes a send hands over: the transport holds at most about this past its high water mark


class HeldAnswer(ORJSONResponse):
    def __init__(self, content, release):
        """`content` rendered now (the caller holds the slot; if rendering fails, the caller releases it);
        `await release(error)` once sending ends, however it ends: `error` None once the kernel has taken the
        last byte (where the protocol says; else once the last piece was handed to `send`), else the exception
        that ended it (Cancelled: the connection was lost first)."""
        super().__init__(content)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        # the connection's loss and when its bytes are all the kernel's, where the server reports them
        # (server/http/frontend.DisconnectWatch); without it an answer cut short is counted as answered, as it was
        watch = scope.get("extensions", {}).get("surge.disconnect")
        error = None
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            body, self.body = memoryview(self.body), b""
            last = max(len(body) - 1, 0) // PIECE * PIECE
            for at in range(0, last + 1, PIECE):
                await send({"type": "http.response.body", "body": bytes(body[at:at + PIECE]), "more_body": at < last})
                # uvicorn's send writes nothing once the connection is lost, and it cannot be lost between its
                # write and its return (connection_lost comes in a later turn): lost now, this piece was dropped
                if watch is not None and watch.lost:
                    error = Cancelled("the connection was lost before the answer was sent")
                    break
                # a turn of the loop: a corking transport (server/http/frontend._Corked) writes what it was
                # given, so that a full buffer pauses the next send instead of everything being queued at once
                await asyncio.sleep(0)
            del body
            when_sent = getattr(watch, "when_sent", None)
            if error is None and when_sent is not None and not await _taken(when_sent):
                error = Cancelled("the connection was lost before the kernel took the answer's last byte")
        except BaseException as exc:
            error = exc
            raise
        finally:
            await self._release(error)


async def _taken(when_sent) -> bool:
    """True once every byte written on the connection is the kernel's, False if the connection is lost first."""
    taken = asyncio.get_running_loop().create_future()

    def sent(ok: bool) -> None:
        if not taken.done():  # the task may have been cancelled meanwhile
            taken.set_result(ok)

    when_sent(sent)
    return await taken

"""A JSON answer whose bytes stay under admission control until the transport has taken them all.

A Response renders its whole body and uvicorn hands it to the transport in one write, which buffers all of
it for as long as the client takes to read: nothing bounds what slow readers hold. POST /embed_all's
answers are large (every token's hidden state, ~3x the float rows as JSON), so its route answers with
this one instead: the body is rendered while the request's admission slot is still held, then sent in
pieces, and uvicorn's `send` takes a piece only once the transport's buffer has drained below its high
water mark (its flow control), i.e. as the client reads. `release` (the slot) runs once the last piece
has been taken or the sending ends otherwise (the client gone, the task cancelled): the memory held for
answers not yet read is then bounded by admission, and past the bound the next request is a 429.

A client that stops reading is cut by the connection's send deadline (--send-timeout-s:
server/http/conn_guard.py): the connection is lost, uvicorn's `send` returns without waiting and drops
what it is given, and the answer stops there. Such an answer, or one whose sending failed, is not one
answered: `release` gets the error (Cancelled for a client gone before the last piece was taken), so that
the request counts as a failure under its code, as one whose client left while it was computed does.
"""

from __future__ import annotations

import asyncio

from surge.errors import Cancelled
from surge.server.http.common import ORJSONResponse

PIECE = 256 * 1024  # bytes a send hands over: the transport holds at most about this past its high water mark


class HeldAnswer(ORJSONResponse):
    def __init__(self, content, release):
        """`content` rendered now (the caller holds the slot; if rendering fails, the caller releases it);
        `await release(error)` once sending ends, however it ends: `error` None once the last piece was
        taken, else the exception that ended it (Cancelled: the connection was lost first)."""
        super().__init__(content)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        # the connection's loss, where the server reports it (server/http/frontend.DisconnectWatch); without
        # it an answer cut short is counted as answered, as it was
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
        except BaseException as exc:
            error = exc
            raise
        finally:
            await self._release(error)

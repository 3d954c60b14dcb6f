"""Answers computed and never delivered count as their clients' leaving.

The runtime counts a request answered when it hands its answer over; gRPC then writes it. A call whose answer is
lost after that (the send deadline cut its connection: send_deadline.py; or, for a stream, the call ended before
the response was written) never delivered it: the request counts, on its model's metrics, as a failure
"cancelled", as the HTTP port counts an answer cut before its last byte (server/http/held_answer.py) and a stream
closed before its last event. Before, such a call was counted answered.

grpc.aio tells a unary handler nothing of how the writing of its answer ended (a failed final write is dropped
silently, and ServicerContext.cancelled() is only what the handler set itself); the send deadline is what knows it
cut a call, so a handler notes here what its lost answer costs (`on_cut`) and the send deadline calls `cut`.
Calls of every server in the process share the one table: each call's own context is its key, and an entry lives
from its answer's return until the call is done.
"""

from __future__ import annotations

from collections.abc import Callable

from surge.errors import SurgeError
from surge.runtime.outcome import counts_of

CODE = "cancelled"

_on_cut: dict[object, Callable[[], None]] = {}


def counts_for(registry, response):
    """Where the request that `response` (a ModelInferResponse) answers is counted, or None (its model is gone,
    or counts in another process)."""
    try:
        return counts_of(registry.get(response.model_name, response.model_version or None))
    except SurgeError:
        return None


def on_cut(context, counts) -> None:
    """The unary call of `context` answers a request counted on `counts` (None: nowhere): a failure "cancelled"
    if its answer is cut before it is written."""
    if counts is not None:
        _on_cut[context] = lambda: counts.failure(CODE)
        context.add_done_callback(_forget)


def cut(context) -> None:
    """The call of `context` is cut with its answer unwritten (send_deadline.py)."""
    lost = _on_cut.pop(context, None)
    if lost is not None:
        lost()


def _forget(context) -> None:
    _on_cut.pop(context, None)

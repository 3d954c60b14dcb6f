"""The shape both deadline interceptors share (read_deadline.py, send_deadline.py): grpc.aio asks an interceptor for
the method handler of every call; each method's handler is wrapped once and the same wrapped object given to every
call, so that a call costs a dict look-up, and an interceptor before this one that caches by handler (the read
deadline does) keeps hitting its cache."""

from __future__ import annotations

import abc

import grpc


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """Subclasses give `_wrap(handler) -> handler` (the handler itself when there is nothing to wrap)."""

    def __init__(self):
        # The wrapped handler of each method handler grpc resolves (the same object for every call).
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        known = self._wrapped.get(id(handler))
        if known is None or known[0] is not handler:
            if len(self._wrapped) >= 4096:  # a generic handler that makes a new handler per call: stay bounded
                self._wrapped.clear()
            known = self._wrapped[id(handler)] = (handler, self._wrap(handler))
        return known[1]

    @abc.abstractmethod
    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The handler to give every call of `handler`'s method."""

"""(Run from any directory with PYTHONPATH=<tree>/src.) Per-call counting bookkeeping of a unary ModelInfer on the gRPC port, as the tree on PYTHONPATH does it:
the runtime's latency count, the interceptor's send-deadline arming and done callback, and (old) undelivered's
registry look-up and cut entry / (new) the Delivery the count waits on. A stand-in context (grpc.aio's own
add_done_callback shape: partial + list), a real ModelRegistry, ServiceMetrics and SendDeadlineInterceptor."""
import asyncio
import functools
import statistics
import sys
import time

from surge.runtime.metrics import ServiceMetrics
from surge.runtime.registry import ModelRegistry
from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import send_deadline

NEW = "_done" in dir(send_deadline.SendDeadlineInterceptor)
if NEW:
    from surge.runtime.outcome import Delivery, answered, awaiting, stop_awaiting
else:
    from surge.server.grpc import undelivered


class Ctx:
    __slots__ = ("callbacks",)

    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, cb):
        self.callbacks.append(functools.partial(cb, self))

    def peer(self):
        return "ipv4:127.0.0.1:1"


class Svc:
    def __init__(self, m):
        self.name, self.version, self.metrics, self.ready = "m", "1", m, True


async def main(n, rounds):
    m = ServiceMetrics("m", "1")
    reg = ModelRegistry()
    reg.add(Svc(m))
    icpt = send_deadline.SendDeadlineInterceptor(600.0, 1)
    response = pb.ModelInferResponse(model_name="m", model_version="1")
    out = []
    for _ in range(rounds):
        ctxs = [Ctx() for _ in range(n)]
        t0 = time.perf_counter()
        if NEW:
            for ctx in ctxs:
                d = Delivery()
                token = awaiting(d)
                answered(m, 0.001)            # the runtime's count: deferred
                stop_awaiting(token)
                icpt._until_done(ctx, d)
                for cb in ctx.callbacks:      # the call is done: counted
                    cb()
        else:
            for ctx in ctxs:
                m.latency.observe(0.001)      # the runtime's count
                if not BASE:
                    undelivered.on_cut(ctx, undelivered.counts_for(reg, response))
                icpt._until_done(ctx)
                for cb in ctx.callbacks:
                    cb()
        out.append((time.perf_counter() - t0) / n * 1e6)
    return out


BASE = len(sys.argv) > 3
us = asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
print(("new" if NEW else "base" if BASE else "old"), f"{statistics.median(us):.3f}", " ".join(f"{u:.3f}" for u in us))

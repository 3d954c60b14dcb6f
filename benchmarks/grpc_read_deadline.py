"""What the gRPC read deadline (server/grpc/read_deadline.py) costs the server: its CPU time per unary call
and per message of a request stream, without it, with an interceptor that only passes the handler through
(grpc.aio's interceptor chain alone), with it, and with the send deadline (server/grpc/send_deadline.py) too, as
the server runs them.

    PYTHONPATH=src python3 benchmarks/grpc_read_deadline.py [--rounds 7 --calls 3000 --concurrency 16]

Each round starts one grpc.aio server per mode in turn (in this process, an echo service: unary-unary, the
shape both wrap, and stream-stream, which the read deadline passes through: request streams may wait; the send
deadline times each response), after one round not counted, and a client in a separate
process (so that its CPU is not counted) that warms up, then makes CALLS unary calls, CONCURRENCY at a time,
and sends CALLS messages on CONCURRENCY streams. The server's CPU is read around the measured parts only, on
its event loop's thread (where all the Python runs) and on all its threads (grpc core's included); the table
gives medians over rounds and each mode's ratio to "none".
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from surge.server.grpc.read_deadline import ReadDeadlineInterceptor
from surge.server.grpc.send_deadline import SendDeadlineInterceptor

UNARY, STREAM = "/bench.Echo/Unary", "/bench.Echo/Stream"


class PassThrough(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        return await continuation(details)


# The send deadline's port only names the connections it looks at once an answer has waited (none here): 0.
INTERCEPTORS = {"none": list, "pass-through interceptor": lambda: [PassThrough()],
                "read deadline": lambda: [ReadDeadlineInterceptor(60.0)],
                "read + send deadlines": lambda: [ReadDeadlineInterceptor(60.0), SendDeadlineInterceptor(60.0, 0)]}


async def unary(request, context):
    return request


async def stream(requests, context):
    async for request in requests:
        yield request


def echo_handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("bench.Echo", {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_stream_rpc_method_handler(stream)})


async def client(port: int, calls: int, concurrency: int) -> None:
    """Prints 'unary', 'stream', 'done' as each measured part starts and ends (the server reads its CPU then)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call_unary, call_stream = channel.unary_unary(UNARY), channel.stream_stream(STREAM)

        async def unary_calls(n):
            for _ in range(n):
                await call_unary(b"x" * 64)

        async def one_stream(n):
            async def requests():
                for _ in range(n):
                    yield b"x" * 64
            async for _ in call_stream(requests()):
                pass

        await asyncio.gather(*(unary_calls(100) for _ in range(concurrency)), one_stream(200))  # warm up
        for label, work in (("unary", unary_calls), ("stream", one_stream)):
            print(label, flush=True)
            await asyncio.gather(*(work(calls // concurrency) for _ in range(concurrency)))
        print("done", flush=True)


async def one_round(mode: str, calls: int, concurrency: int) -> dict[str, float]:
    """Server CPU microseconds per unary call and per stream message under `mode`: the event loop's thread and
    the whole process."""
    server = grpc.aio.server(interceptors=INTERCEPTORS[mode](), maximum_concurrent_rpcs=1024)
    server.add_generic_rpc_handlers((echo_handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "--client", str(port), "--calls",
                                                str(calls), "--concurrency", str(concurrency),
                                                stdout=asyncio.subprocess.PIPE)
    marks = {}
    while line := (await proc.stdout.readline()).decode().strip():
        marks[line] = (time.thread_time(), time.process_time())
    await proc.wait()
    await server.stop(None)
    n = calls // concurrency * concurrency
    out = {}
    for i, clock in enumerate(("loop", "process")):
        out[f"unary {clock}"] = (marks["stream"][i] - marks["unary"][i]) / n * 1e6
        out[f"stream {clock}"] = (marks["done"][i] - marks["stream"][i]) / n * 1e6
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        asyncio.run(client(args.client, args.calls, args.concurrency))
        return
    results: dict[str, list[dict]] = {mode: [] for mode in INTERCEPTORS}
    for mode in INTERCEPTORS:  # a round not counted: this process's first servers pay for imports and caches
        asyncio.run(one_round(mode, args.calls // 4, args.concurrency))
    for _ in range(args.rounds):
        for mode in INTERCEPTORS:  # alternating, so that drift in the machine's load hits every mode alike
            results[mode].append(asyncio.run(one_round(mode, args.calls, args.concurrency)))
    keys = ("unary loop", "unary process", "stream loop", "stream process")
    base = {k: statistics.median(r[k] for r in results["none"]) for k in keys}
    print(f"server CPU, µs per unary call and per stream message, median of {args.rounds} rounds ({args.calls} "
          f"calls, {args.calls} messages, {args.concurrency} at a time; grpcio {grpc.__version__}); loop: the "
          "event loop's thread (all Python), process: every thread (grpc core's too); ratio: to none")
    print(f"{'mode':<26}" + "".join(f"{k:>16}{'ratio':>7}" for k in keys))
    for mode, rounds in results.items():
        row = {k: statistics.median(r[k] for r in rounds) for k in keys}
        print(f"{mode:<26}" + "".join(f"{row[k]:>16.1f}{row[k] / base[k]:>7.3f}" for k in keys))


if __name__ == "__main__":
    main()

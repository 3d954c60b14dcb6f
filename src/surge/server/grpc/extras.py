"""Triton's gRPC extras on the KServe servicer: ModelStreamInfer (bidirectional
streaming), LogSettings, TraceSetting and the shared-memory RPCs.

ModelStreamInfer: each request on the stream runs as soon as it arrives (up to
STREAM_INFLIGHT at once per stream, then reading waits), through the same path
as ModelInfer; at most STREAM_WAITING answers wait to be sent (then the requests
that made more wait, and with them the reading: a client that sends fast and reads
slowly, which --send-timeout-s never cuts, once had every answer held here); each response carries its request's id, in completion order, as
Triton's decoupled streams do. A generate model's request with `stream` true gets
a response a delta (server/kserve_generate_infer.py). An error belongs to its request: it comes back
as that response's error_message (naming the request id, since tritonclient's
stream callback gets only the message) and the stream goes on. A request counts answered (latency, KServe
statistics) once grpc.aio has written its last response, and once, as a failure "cancelled", where the stream ends
before that (the send deadline cut it, its client left): each request's task awaits a Delivery (runtime/outcome.py)
that its last response carries to the writer.
"""

from __future__ import annotations

import asyncio
import logging

from surge.errors import SurgeError
from surge.runtime.outcome import CANCELLED, Delivery, awaiting
from surge.server import triton_settings as settings
from surge.server.grpc import grpc_service_pb2 as pb

log = logging.getLogger("surge.server")
STREAM_INFLIGHT = 64
STREAM_WAITING = 64  # answers of a stream made and not yet taken by grpc (its client's window full)


def _stream_error(request, message: str) -> pb.ModelStreamInferResponse:
    text = f"request '{request.id}': {message}" if request.id else message
    return pb.ModelStreamInferResponse(error_message=text, infer_response=pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id))


def _log_values(entries) -> dict:
    out = {}
    for key, value in entries.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(value, which)
    return out


def _log_response(values: dict) -> pb.LogSettingsResponse:
    resp = pb.LogSettingsResponse()
    for key, value in values.items():
        if isinstance(value, bool):
            resp.settings[key].bool_param = value
        elif isinstance(value, int):
            resp.settings[key].uint32_param = value
        else:
            resp.settings[key].string_param = value
    return resp


def _trace_response(values: dict) -> pb.TraceSettingResponse:
    resp = pb.TraceSettingResponse()
    for key, value in values.items():
        resp.settings[key].value.extend(value if isinstance(value, list) else [value])
    return resp


class TritonExtras:
    """Mixed into InferenceServicer: needs `self._infer_stream(request)` (the responses to one request:
    one, or a streamed generation's) and `self.registry`."""

    async def ModelStreamInfer(self, request_iterator, context):
        # (message, delivery): delivery, where the message is its request's last response, settles what the
        # request counts: answered once the message is written, "cancelled" if the call ends before
        out: asyncio.Queue = asyncio.Queue()  # the answers, then None; `room` bounds how many wait in it
        room = asyncio.Semaphore(STREAM_WAITING)
        slots = asyncio.Semaphore(STREAM_INFLIGHT)
        tasks: set[asyncio.Task] = set()
        sending = None  # the item handed to grpc.aio, until it has written it

        async def put(item) -> None:
            try:
                await room.acquire()  # the client's window is full: this request, and past STREAM_INFLIGHT the reading, wait
            except asyncio.CancelledError:  # the call ended: an answer computed and never queued is lost too
                if item[1] is not None:
                    item[1].settle(CANCELLED)
                raise
            out.put_nowait(item)

        async def one(request):
            delivery = Delivery()
            awaiting(delivery)  # this request's own task: what the runtime counts answered waits for the writing
            try:
                async for response, last in self._infer_stream(request):
                    await put((pb.ModelStreamInferResponse(infer_response=response), delivery if last else None))
            except SurgeError as exc:
                delivery.settle(None)  # an error answered: counted as it was (its failure where it arose)
                await put((_stream_error(request, exc.message), None))
            except Exception:  # noqa: BLE001 - logged, answered like ModelInfer's catch-all
                log.exception("unhandled error in gRPC ModelStreamInfer")
                delivery.settle(None)
                await put((_stream_error(request, "internal server error"), None))
            except BaseException:  # the stream ended before its answer was queued
                delivery.settle(CANCELLED)
                raise
            finally:
                slots.release()

        async def read():
            try:
                async for request in request_iterator:
                    await slots.acquire()
                    task = asyncio.ensure_future(one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:  # the client closed its side: finish what it sent
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                out.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (sending := await out.get()) is not None:
                room.release()
                yield sending[0]  # resumed once grpc.aio has written it
                if sending[1] is not None:
                    sending[1].settle(None)  # its request's answer delivered
                sending = None
            await reader
        finally:
            reader.cancel()
            for task in list(tasks):  # the client went away: stop its work (counted "cancelled" where it runs)
                task.cancel()
            # ...and what was computed and not written (the response being written when the call ended, those
            # waiting to be): nothing is left on a stream that ended whole
            lost = [sending] if sending is not None else []
            while not out.empty():
                lost.append(out.get_nowait())
            for item in lost:
                if item is not None and item[1] is not None:
                    item[1].settle(CANCELLED)

    async def LogSettings(self, request, context):
        return await self._answer(context, lambda: _log_response(
            settings.update_log_settings(_log_values(request.settings))))

    async def TraceSetting(self, request, context):
        def run():
            if request.model_name:
                self.registry.get(request.model_name)
            changes = {k: (list(v.value) or None) for k, v in request.settings.items()}
            return _trace_response(settings.update_trace_settings(changes))
        return await self._answer(context, run)

    async def _unsupported(self, request, context):
        return await self._answer(context, settings.shared_memory)

    SystemSharedMemoryStatus = SystemSharedMemoryRegister = SystemSharedMemoryUnregister = _unsupported
    CudaSharedMemoryStatus = CudaSharedMemoryRegister = CudaSharedMemoryUnregister = _unsupported

    @staticmethod
    async def _answer(context, build):
        try:
            return build()
        except SurgeError as exc:
            await context.abort(exc.grpc_code, exc.message)

"""inference.GRPCInferenceService (KServe v2 / Open Inference Protocol over gRPC).

A thin layer: protobuf in, the shared tensor contract (server/kserve_contract.py)
and AppState.run, protobuf out. A SurgeError becomes its gRPC status
(errors.SurgeError.grpc_code) with the message as details; anything else is
logged and answered INTERNAL, never with a stack trace.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc

from surge.errors import InvalidInput, NotFound, SurgeError, shown
from surge.runtime.off_loop import prepared
from surge.server import kserve_contract as contract
from surge.server import kserve_generate_infer as gen
from surge.server import kserve_tensor
from surge.server.grpc import grpc_service_pb2 as pb
from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc
from surge.server.grpc.extras import TritonExtras
from surge.server.state import AppState

log = logging.getLogger("surge.server")

# The typed `contents` field that carries each datatype when raw_input_contents is not used.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}


def _rpc(method):
    """Map errors to status codes in one place for every RPC."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        trailers = ()
        try:
            return await method(self, request, context)
        except SurgeError as exc:
            code, message = exc.grpc_code, exc.message
            trailers = retry_trailers(exc.retry_after)
        except Exception:
            log.exception("unhandled error in gRPC %s", method.__name__)
            code, message = grpc.StatusCode.INTERNAL, "internal server error"
        await context.abort(code, shown(message, 1024), trailing_metadata=trailers)  # bounded, as HTTP's

    return wrapper


def retry_trailers(retry_after: float | None) -> tuple:
    """HTTP's Retry-After for gRPC: `retry-after` (whole seconds, as the HTTP header) and
    gRPC's own retry pushback (`grpc-retry-pushback-ms`, which grpc clients with a
    retry policy obey) in the trailing metadata of an overload answer."""
    if retry_after is None:
        return ()
    seconds = max(1, int(round(retry_after)))
    return (("retry-after", str(seconds)), ("grpc-retry-pushback-ms", str(seconds * 1000)))


def parameters(entries) -> dict:
    """A protobuf map<string, InferParameter> as plain Python values."""
    out = {}
    for key, value in entries.items():
        which = value.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(value, which)
    return out


def _set_param(entries, key: str, value) -> None:
    if isinstance(value, bool):
        entries[key].bool_param = value
    elif isinstance(value, int):
        entries[key].int64_param = value
    elif isinstance(value, float):
        entries[key].double_param = value
    else:
        entries[key].string_param = str(value)


def decode_inputs(request: pb.ModelInferRequest) -> list[contract.InputTensor]:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs; "
                           "send one per input, in order, or none")
    tensors = []
    for i, t in enumerate(request.inputs):
        if raw:
            if t.HasField("contents"):
                raise InvalidInput(f"input '{shown(t.name)}' has both contents and raw_input_contents")
            tensors.append(contract.from_raw(t.name, t.datatype, t.shape, raw[i]))
            continue
        field = _CONTENTS_FIELD.get(t.datatype)
        if field is None:
            contract.numpy_dtype(t.name, t.datatype)  # unknown datatype: a clear error
            raise InvalidInput(f"input '{shown(t.name)}': {shown(t.datatype)} data must be sent in raw_input_contents")
        tensors.append(contract.from_values(t.name, t.datatype, t.shape, list(getattr(t.contents, field))))
    return tensors


async def _decoded(request: pb.ModelInferRequest) -> list[contract.InputTensor]:
    """decode_inputs(request): a large request's (its encoded size) on a preparation thread, its values checked
    and converted one by one (819,200 ids: ~200 ms) there rather than on the event loop."""
    return await prepared(request.ByteSize(), decode_inputs, request)


def _stats_proto(d: dict) -> pb.ModelStatistics:
    inference = pb.InferStatistics(**{k: pb.StatisticDuration(**v) for k, v in d["inference_stats"].items()})
    return pb.ModelStatistics(name=d["name"], version=d["version"], last_inference=d["last_inference"],
                              inference_count=d["inference_count"], execution_count=d["execution_count"],
                              inference_stats=inference)


class InferenceServicer(TritonExtras, pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, state: AppState):
        self.state = state
        self.registry = state.registry
        self.limits = state.config.limits

    def _service(self, name: str, version: str):
        """The model a request names. An empty name names none, as HTTP's /v2/models//... (404), rather than
        the registry's default model."""
        if not name:
            raise NotFound("the request names no model (model name is empty)", param="model")
        return self.registry.get(name, version or None)

    def _lifecycle(self):
        if self.state.lifecycle is None:
            raise NotFound("this server has no model repository")
        return self.state.lifecycle

    @_rpc
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(self, request, context):
        ready = self.state.started and all(s.ready for s in self.registry.services())
        return pb.ServerReadyResponse(ready=ready)

    @_rpc
    async def ModelReady(self, request, context):
        try:
            service = self._service(request.name, request.version)
        except NotFound:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=service.ready)

    @_rpc
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(**contract.server_metadata())

    @_rpc
    async def ModelMetadata(self, request, context):
        service = self._service(request.name, request.version)
        versions = [request.version] if request.version else self.registry.versions(request.name)
        meta = contract.model_metadata(service, versions)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        inputs=[tensor(**t) for t in meta["inputs"]],
                                        outputs=[tensor(**t) for t in meta["outputs"]])

    @_rpc
    async def ModelInfer(self, request, context):
        # counted answered once grpc.aio has written it, "cancelled" if it is cut first (send_deadline.py)
        return await self._infer(request)

    async def _infer(self, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
        """One inference (ModelInfer, and each request of ModelStreamInfer); raises SurgeError."""
        service = self._service(request.model_name, request.model_version)
        outputs = [(o.name, parameters(o.parameters)) for o in request.outputs]
        if kserve_tensor.is_tensor_model(service):
            return await self._tensor_infer(service, request, outputs)
        if getattr(service, "task", "embed") == "generate":  # server/kserve_generate_infer.py's contract
            p = await self._generate_prepare(request)
            return self._generate_response(request, p, await gen.answer(self.state, p))
        if getattr(service, "task", "embed") in ("classify", "rerank", "token-classify"):  # task models: server/kserve_tasks.py's contract
            from surge.server import kserve_tasks

            result, arrays = await kserve_tasks.infer(self.state, service, await _decoded(request),
                                                      parameters(request.parameters), outputs, self.limits)
            wanted = {n for n, _ in outputs}
            response = pb.ModelInferResponse(model_name=result.model, model_version=result.version, id=request.id)
            _set_param(response.parameters, "prompt_tokens", int(result.prompt_tokens))
            for name, dtype, array in arrays:
                if not wanted or name in wanted:
                    response.outputs.add(name=name, datatype=dtype, shape=list(array.shape))
                    response.raw_output_contents.append(kserve_tensor.raw_bytes(array))  # BYTES too
            return response
        decoded = contract.decode_request(await _decoded(request), parameters(request.parameters), outputs,
                                          self.limits.max_inputs_per_request, self.limits.max_input_chars)
        result = await self.state.run(service, texts=decoded.texts, token_ids=decoded.token_ids,
                                      options=decoded.options)
        datatype, array = contract.embedding_output(result.vectors, decoded)
        response = pb.ModelInferResponse(model_name=result.model, model_version=result.version, id=request.id)
        _set_param(response.parameters, "prompt_tokens", int(result.prompt_tokens))
        response.outputs.add(name=contract.EMBEDDING, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(kserve_tensor.raw_bytes(array))  # BYTES too (a classification output)
        return response

    async def _generate_prepare(self, request):
        """A large request (its encoded size: ByteSize, computed natively) is prepared on a preparation thread
        (runtime/off_loop.py)."""
        return await gen.prepared(self.state, request.ByteSize(), request.model_name, request.model_version or None,
                                  functools.partial(decode_inputs, request), parameters(request.parameters),
                                  [o.name for o in request.outputs])

    @staticmethod
    def _generate_response(request, p, arrays) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(model_name=p.service.name, model_version=p.service.version, id=request.id)
        for name, dtype, array in arrays:
            response.outputs.add(name=name, datatype=dtype, shape=list(array.shape))
            response.raw_output_contents.append(kserve_tensor.raw_bytes(array))
        return response

    async def _infer_stream(self, request):
        """ModelStreamInfer's responses to one request, each as (response, last): one, or a streamed generation's
        deltas (each with `triton_final_response`, true on the last, as Triton's decoupled models answer)."""
        service = self._service(request.model_name, request.model_version)
        if getattr(service, "task", "embed") == "generate":
            p = await self._generate_prepare(request)
            if p.flags.get("stream"):
                async for arrays, final in gen.stream(self.state, p):
                    response = self._generate_response(request, p, arrays)
                    _set_param(response.parameters, "triton_final_response", final)
                    yield response, final
            else:  # _infer's answer, without preparing the request a second time
                yield self._generate_response(request, p, await gen.answer(self.state, p)), True
            return
        yield await self._infer(request), True

    async def _tensor_infer(self, service, request, outputs):
        result, arrays = await kserve_tensor.infer(self.state, service, await _decoded(request), outputs,
                                                   parameters(request.parameters))
        response = pb.ModelInferResponse(model_name=result.model, model_version=result.version, id=request.id)
        for name, array in arrays:
            response.outputs.add(name=name, datatype=kserve_tensor.datatype_of(array), shape=list(array.shape))
            response.raw_output_contents.append(kserve_tensor.raw_bytes(array))
        return response

    @_rpc
    async def ModelConfig(self, request, context):
        service = self._service(request.name, request.version)
        return pb.ModelConfigResponse(config=kserve_tensor.model_config_proto(service))

    @_rpc
    async def ModelStatistics(self, request, context):
        if not request.name:
            services = self.registry.services()
        elif not request.version:
            self.registry.get(request.name)
            services = [self.registry.get(request.name, v) for v in self.registry.versions(request.name)]
        else:
            services = [self.registry.get(request.name, request.version)]
        return pb.ModelStatisticsResponse(
            model_stats=[_stats_proto(self.state.stats.snapshot(s.name, s.version)) for s in services])

    @_rpc
    async def RepositoryIndex(self, request, context):
        models = contract.repository_index(await self._lifecycle().index(), request.ready)
        index = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[index(**m) for m in models])

    @_rpc
    async def RepositoryModelLoad(self, request, context):
        await _finish(self._lifecycle().load(request.model_name,
                                             contract.check_load_parameters(_repo_params(request))))
        return pb.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(self, request, context):
        await _finish(self._lifecycle().unload(request.model_name,
                                               contract.check_load_parameters(_repo_params(request))))
        return pb.RepositoryModelUnloadResponse()


async def _finish(operation) -> None:
    # An RPC cancelled by its deadline or its client must not cancel a load or unload halfway
    # (a version left LOADING, a build never closed): the operation runs to its end in the
    # background, as the native HTTP routes' (server/http/models.py `finish`).
    await asyncio.shield(asyncio.ensure_future(operation))


def _repo_params(request) -> dict:
    """A map<string, ModelRepositoryParameter> as plain Python values."""
    out = {}
    for key, value in request.parameters.items():
        which = value.WhichOneof("parameter_choice")
        out[key] = None if which is None else getattr(value, which)
    return out

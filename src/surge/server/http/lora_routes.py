"""vLLM's routes for LoRA adapters loaded and unloaded while serving:

POST /v1/load_lora_adapter    {"lora_name": "x", "lora_path": "/dir", "model"?: base, "load_inplace"?: bool}
POST /v1/unload_lora_adapter  {"lora_name": "x"}

Answered as vLLM answers (200 with a line of text), allowed only with the generation setting
`allow_runtime_lora` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): the server then reads any directory
the request names. The adapter is then a model of its own name in every API (/v1/models lists it
with its `parent`). `model` names the base model where several decoders could take it.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr

from surge.errors import ConfigError, InvalidInput, NotFound, Unsupported, shown
from surge.server.http.common import parse
from surge.server.http.generate_common import generate_model
from surge.server.http.openapi import body
from surge.server.state import AppState


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_path: StrictStr
    model: StrictStr | None = None  # surge's: the base model, where several decoders are served
    load_inplace: StrictBool = False  # vLLM's: replace an adapter of the same name
    lora_int_id: StrictInt | None = None  # vLLM clients may send it; the server assigns slots itself


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None


def _base_for(state: AppState, name: str | None):
    if name is not None:
        return generate_model(state, name)
    with_slots = [s for s in state.registry.services() if getattr(s, "task", "") == "generate"
                  and getattr(s, "adapter", None) is None and getattr(s, "adapters", None) is not None
                  and s.config.max_loras and s is state.registry.get(s.name)]
    if len(with_slots) != 1:
        found = ", ".join(sorted(s.name for s in with_slots)) or "none"
        raise InvalidInput(f"name the base model with 'model' (decoder models with LoRA slots: {found})",
                           param="model")
    return with_slots[0]


def _allowed(service) -> None:
    if not service.runtime_adapters:
        why = "its engine is not this server's alone (--workers front ends, Ray Serve replicas)" \
            if service.config.allow_runtime_lora else "start the server with --generation allow_runtime_lora=true"
        raise Unsupported(f"model '{service.name}' does not load LoRA adapters at run time: {why}")


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limit = state.config.limits.max_body_bytes
    lock = asyncio.Lock()  # one change at a time: a slot is chosen and taken in one step

    @r.post("/v1/load_lora_adapter", openapi_extra=body(LoadLoraRequest))
    async def load(request: Request):
        req = await parse(request, LoadLoraRequest, limit)
        name = req.lora_name.strip()
        if not name or not req.lora_path.strip():
            raise InvalidInput("lora_name and lora_path must not be empty", param="lora_name")
        if "\x00" in req.lora_path:  # no file system path holds one (os calls raise ValueError)
            raise InvalidInput("lora_path must not contain a NUL character", param="lora_path")
        async with lock:
            service = _base_for(state, req.model)
            _allowed(service)
            if name in service.adapters and not req.load_inplace:
                raise InvalidInput(f"the LoRA adapter '{shown(name)}' has already been loaded", param="lora_name")
            if name not in service.adapters and name in state.registry.names():
                raise InvalidInput(f"'{shown(name)}' is the name of a served model", param="lora_name")
            try:
                checked = await asyncio.to_thread(service.check_adapter, name, req.lora_path)
            except ConfigError as exc:  # the request's directory, not the server's configuration
                raise InvalidInput(exc.message, param="lora_path") from None
            if name in service.adapters:  # load_inplace: the old one stops taking requests first
                state.registry.remove(name, service.remove_adapter(name).version)
            state.registry.add(service.add_adapter(name, req.lora_path, checked))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @r.post("/v1/unload_lora_adapter", openapi_extra=body(UnloadLoraRequest))
    async def unload(request: Request):
        req = await parse(request, UnloadLoraRequest, limit)
        async with lock:
            try:
                view = state.registry.get(req.lora_name)
            except NotFound:
                view = None
            if view is None or getattr(view, "adapter", None) is None:
                raise NotFound(f"the LoRA adapter '{shown(req.lora_name)}' is not loaded", param="lora_name")
            _allowed(view.base)
            view.base.remove_adapter(view.name)
            state.registry.remove(view.name, view.version)
            # what was counted under its name goes with it: the names are the clients' choice
            view.base.metrics.forget_adapter(view.name)
            state.stats.forget(view.name, view.version)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return r

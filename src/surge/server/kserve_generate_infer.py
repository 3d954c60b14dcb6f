"""KServe v2 inference on a decoder model, as Triton's vLLM backend takes it (what tritonclient users of
Triton + vLLM send):

  in   text_input               BYTES [1]  the prompt
       stream                   BOOL  [1]  optional: one response a delta (gRPC ModelStreamInfer only)
       sampling_parameters      BYTES [1]  optional: a JSON object (max_tokens, temperature, top_p, ...,
                                           and the structured-output fields: guided_json, guided_regex,
                                           guided_choice, guided_grammar, structured_outputs)
       exclude_input_in_output  BOOL  [1]  optional: a non-streamed text_output without the prompt
                                           (default false: prompt + completion, as the vLLM backend; a
                                           stream never has the prompt, and false there is refused)
       return_finish_reason / return_cumulative_logprob / return_logprobs / return_num_input_tokens /
       return_num_output_tokens  BOOL [1]  optional (server/kserve_generate_outputs.py)
  out  text_output              BYTES [1]  (and finish_reason BYTES, cumulative_logprob FP32, logprobs BYTES
                                           (JSON), num_input_tokens / num_output_tokens UINT32, when asked;
                                           a stream's num_output_tokens and logprobs: its response's tokens)

The request's `parameters` may carry the sampling parameters too (as the generate extension's body). A
streamed response's last one has the parameter `triton_final_response` true. Both protocol layers call
`prepared` and encode what `answer` / `stream` give.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from pydantic import ValidationError

from surge import json_depth
from surge.errors import InvalidInput
from surge.runtime import off_loop
from surge.server.http.generate_common import (SAMPLING_FIELDS, counted, counted_stream, deadline_for,
                                               generate_model, make_params)
from surge.server.http.guided_fields import FIELDS as GUIDE_FIELDS
from surge.server.http.guided_fields import asks_guide, guide_from_dict
from surge.server.http.kserve_generate import GenerateParameters
from surge.server.kserve_contract import InputTensor
from surge.server.kserve_generate_outputs import FLAGS as OUTPUT_FLAGS
from surge.server.kserve_generate_outputs import OUTPUT_FLAG as OPTIONAL_OUTPUTS
from surge.server.kserve_generate_outputs import STREAM_PROMPT_ERROR, Extras, check_n, logprobs_wanted

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
FLAGS = ("stream", *OUTPUT_FLAGS)
KNOWN = {TEXT_INPUT, "sampling_parameters", *FLAGS}
# what sampling_parameters may hold besides SAMPLING_FIELDS and the structured-output fields: vLLM's names
# that surge's KServe routes honour (server/kserve_generate_outputs.py)
VLLM_EXTRAS = ("logprobs", "n")


@dataclass
class Prepared:
    service: object
    prompt: str
    ids: list[int]
    params: object
    flags: dict
    wanted: set  # the outputs the request names (empty: all it asked for)


def _one(t: InputTensor, datatype: str):
    if t.datatype != datatype:
        raise InvalidInput(f"input '{t.name}' must have datatype {datatype}, got {t.datatype}", param=t.name)
    if len(t.values) != 1:
        raise InvalidInput(f"input '{t.name}' must hold one element (shape [1] or [1,1]), got shape "
                           f"{list(t.shape)}", param=t.name)
    return t.values[0]


def _checked(sampling: dict) -> dict:
    """The sampling fields typed as the generate extension types them (GenerateParameters), strictly: JSON and
    gRPC parameters carry their own types, so a string or a fraction where an integer belongs is refused by
    name here. Unchecked, such a value failed inside the engine's decode step, and with it every request
    sharing that step."""
    try:
        return GenerateParameters.model_validate(sampling, strict=True).model_dump(exclude_unset=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else "sampling_parameters"
        raise InvalidInput(f"sampling parameter '{field}' is invalid: {first['msg']}", param=field) from None


async def prepared(state, size: int | None, name: str, version: str | None,
                   inputs: Callable[[], list[InputTensor]], parameters: dict, requested: list[str] = ()) -> Prepared:
    """The request checked and prepared. `inputs()`: its tensors; `requested`: the names of its `outputs` (none:
    every output it asked for). The work that grows with it (its tensors, the sampling parameters' decode, bad
    words, tokenization) runs on a preparation thread for a request of more than OFF_LOOP_BYTES (`size`: its
    encoded size), and the guide's compile whatever the size (runtime/off_loop.py)."""
    head = await off_loop.prepared(size, _head, state, name, version, inputs, parameters)
    return await off_loop.prepared(None if head.guided else size, _finish, head, requested)


@dataclass
class _Head:
    """What a request asks, checked; its guide, sampling parameters and prompt not yet made (`_finish`)."""
    service: object
    prompt: str
    flags: dict
    sampling: dict

    @property
    def guided(self) -> bool:
        """Whether it asks for a structured output (its guide's first compile: ms to s whatever its size)."""
        return asks_guide(SimpleNamespace(**{f: self.sampling.get(f) for f in GUIDE_FIELDS}))


def _head(state, name: str, version: str | None, inputs: Callable[[], list[InputTensor]], parameters: dict) -> _Head:
    inputs = inputs()  # decoded first, as the protocol layers did before calling prepare
    service = generate_model(state, name, version)
    by_name = {}
    for t in inputs:
        if t.name in by_name:  # as the other models' contracts: not "the last one wins"
            raise InvalidInput(f"input '{t.name}' is given twice", param=t.name)
        by_name[t.name] = t
    unknown = sorted(set(by_name) - KNOWN)
    if unknown or TEXT_INPUT not in by_name:
        raise InvalidInput(f"a generate model takes '{TEXT_INPUT}' (BYTES [1]) and optionally "
                           f"'sampling_parameters' and {', '.join(repr(f) for f in FLAGS)}"
                           + (f"; got {unknown[0]!r}" if unknown else ""), param=TEXT_INPUT)
    try:
        prompt = _one(by_name[TEXT_INPUT], "BYTES").decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput(f"input '{TEXT_INPUT}' holds invalid UTF-8", param=TEXT_INPUT) from None
    flags = {f: bool(_one(by_name[f], "BOOL")) for f in FLAGS if f in by_name}
    sampling = {k: v for k, v in parameters.items() if k in SAMPLING_FIELDS or k in GUIDE_FIELDS or k in VLLM_EXTRAS}
    if "sampling_parameters" in by_name:
        raw = _one(by_name["sampling_parameters"], "BYTES")
        try:
            given = json_depth.loads(raw)  # bounded: a guide in it goes through json.dumps
        except ValueError:
            raise InvalidInput("sampling_parameters must be a JSON object", param="sampling_parameters") from None
        if not isinstance(given, dict):
            raise InvalidInput("sampling_parameters must be a JSON object", param="sampling_parameters")
        unknown = sorted(set(given) - set(SAMPLING_FIELDS) - set(GUIDE_FIELDS) - set(VLLM_EXTRAS))
        if unknown:  # Triton's vLLM backend fails on a field vLLM lacks; surge on one it does not honour
            raise InvalidInput(f"sampling_parameters: {unknown[0]!r} is not supported (known: "
                               f"{', '.join(SAMPLING_FIELDS + GUIDE_FIELDS + VLLM_EXTRAS)})",
                               param="sampling_parameters")
        sampling.update(given)
    sampling = _checked(sampling)
    check_n(sampling.get("n"))
    if flags.get("stream") and flags.get("exclude_input_in_output") is False:
        raise InvalidInput(STREAM_PROMPT_ERROR, param="exclude_input_in_output")
    return _Head(service, prompt, flags, sampling)


def _finish(head: _Head, requested: list[str]) -> Prepared:
    service, prompt, flags, sampling = head.service, head.prompt, head.flags, head.sampling
    guide = guide_from_dict(sampling, service)
    try:
        params = make_params(service, **{k: sampling.get(k) for k in SAMPLING_FIELDS}, guide=guide,
                             logprobs=logprobs_wanted(flags, sampling.get("logprobs")))
    except (TypeError, ValueError, AttributeError) as exc:  # a value of the wrong type
        raise InvalidInput(f"sampling_parameters: {exc}", param="sampling_parameters") from None
    for out in requested:
        if out != TEXT_OUTPUT and not flags.get(OPTIONAL_OUTPUTS.get(out, "")):
            hint = (f"set the input '{OPTIONAL_OUTPUTS[out]}' to true" if out in OPTIONAL_OUTPUTS
                    else f"a generate model's outputs are {TEXT_OUTPUT!r}, " + ", ".join(map(repr, OPTIONAL_OUTPUTS)))
            raise InvalidInput(f"output '{out}' is not produced: {hint}", param=out)
    ids = service.encode(prompt)
    service.check_prompt(ids)
    return Prepared(service, prompt, ids, params, flags, set(requested))


# the datatype of each additional output, as the vLLM backend's config.pbtxt declares them
_TYPES = {"finish_reason": ("BYTES", object), "cumulative_logprob": ("FP32", np.float32),
          "logprobs": ("BYTES", object), "num_input_tokens": ("UINT32", np.uint32),
          "num_output_tokens": ("UINT32", np.uint32)}


def outputs(p: Prepared, text: str, extras: dict) -> list:
    """[(name, datatype, numpy array)] of one response: the outputs asked for, those the request names."""
    out = [(TEXT_OUTPUT, "BYTES", np.array([text.encode()], dtype=object))]
    for name, value in extras.items():
        datatype, dtype = _TYPES[name]
        if dtype is object:
            value = (value or "").encode()
        out.append((name, datatype, np.array([value], dtype=dtype)))
    return [o for o in out if not p.wanted or o[0] in p.wanted]


async def answer(state, p: Prepared) -> list:
    """A non-streamed answer's outputs."""
    if p.flags.get("stream"):
        raise InvalidInput("'stream' needs gRPC ModelStreamInfer (or POST .../generate_stream)", param="stream")
    res = await counted(state, p.service, p.service.generate(p.ids, p.params, deadline=deadline_for(state)))
    text = res.text if p.flags.get("exclude_input_in_output") else p.prompt + res.text
    extras = Extras(p.flags).values(res.logprobs, res.completion_tokens, res.finish_reason, res.prompt_tokens)
    return outputs(p, text, extras)


async def stream(state, p: Prepared):
    """(outputs, final) a delta; the caller closes it when its client leaves."""
    extras = Extras(p.flags)
    agen = counted_stream(state, p.service, p.service.stream(p.ids, p.params, deadline=deadline_for(state)))
    try:
        async for d in agen:
            final = d.finish_reason is not None
            more = extras.values(d.logprobs, len(d.token_ids), d.finish_reason, d.prompt_tokens)
            yield outputs(p, d.text, more), final
    finally:
        await agen.aclose()

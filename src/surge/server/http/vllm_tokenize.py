"""vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages as the model's template renders them)
and POST /detokenize, for clients that count or build prompts against the server's own tokenizer.

POST /tokenize    {"model", "prompt", "add_special_tokens": true, "return_token_strs": false}
                  or {"model", "messages", "add_generation_prompt": true, "continue_final_message": false,
                      "add_special_tokens": false, "tools", "chat_template_kwargs", "return_token_strs": false}
                  -> {"count", "max_model_len", "tokens", "token_strs"}
POST /detokenize  {"model", "tokens"} -> {"prompt"} (special tokens written out, as vLLM decodes)

TEI's /tokenize ({"inputs": ...}, server/http/tei.py) shares the path: a body with "prompt" or "messages"
is vLLM's (`is_vllm_body`). A prompt works on any model (an encoder's max_model_len is its max_length);
messages need a generation model's chat template (chat completions' rendering, the same tokens).
"""

from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from surge.errors import InvalidInput
from surge.runtime.generate_text import decode_text, encode_text
from surge.server.http.common import ORJSONResponse, checked_body, validate
from surge.server.http.gil_points import each
from surge.server.http.openai_chat_requests import (
    ChatMessage,
    chat_messages,
    refuse_request_template,
)
from surge.server.http.task_io import body_schema


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    messages: list[each(ChatMessage)] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False  # the template writes the special tokens itself
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    chat_template: StrictStr | None = None  # refused (refuse_request_template), as the chat route refuses it
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]


def is_vllm_body(body) -> bool:
    return isinstance(body, dict) and ("prompt" in body or "messages" in body)


def _text_side(served):
    """(tokenizers.Tokenizer, vocabulary size, context length) of a served model."""
    from surge.server.http.tei import _tokenizer

    tok, vocab = _tokenizer(served)
    limit = getattr(served, "max_model_len", None) or getattr(served, "max_length", None)
    return tok, vocab, limit


def tokenize(state, body: dict) -> ORJSONResponse:
    """vLLM's /tokenize of a decoded JSON body (is_vllm_body): the render, tokenization and answer grow with
    the request, so tei's route calls it on a preparation thread for a large body (common.checked_body)."""
    chat = "messages" in body
    req = validate(TokenizeChat if chat else TokenizeCompletion, body)
    served = state.registry.get(req.model)
    tok, _, limit = _text_side(served)
    if chat:
        if getattr(served, "task", None) != "generate":
            raise InvalidInput(f"model '{served.name}' has no chat template: tokenize a 'prompt'", param="messages")
        refuse_request_template(req)
        if req.continue_final_message and req.add_generation_prompt:
            raise InvalidInput("continue_final_message and add_generation_prompt cannot both be true",
                               param="continue_final_message")
        text = served.render_chat(chat_messages(req.messages),
                                  add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                                  continue_final_message=req.continue_final_message,
                                  variables=req.chat_template_kwargs)
    else:
        text = req.prompt
    ids = encode_text(tok, text, req.add_special_tokens)
    return ORJSONResponse({"count": len(ids), "max_model_len": limit, "tokens": ids,
                           "token_strs": [tok.id_to_token(i) for i in ids] if req.return_token_strs else None})


def router(state) -> APIRouter:
    r = APIRouter(tags=["vLLM"])
    limits = state.config.limits

    @r.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize_route(request: Request):
        return await checked_body(request, functools.partial(detokenize, state), limits.max_body_bytes)

    return r


def detokenize(state, body) -> ORJSONResponse:
    """vLLM's /detokenize of a decoded JSON body: on a preparation thread for a large one (its ids' check and
    decode grow with it)."""
    req = validate(DetokenizeRequest, body)
    served = state.registry.get(req.model)
    tok, vocab, _ = _text_side(served)
    if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= vocab):
        raise InvalidInput(f"tokens must be ids in [0, {vocab})", param="tokens")
    return ORJSONResponse({"prompt": decode_text(tok, req.tokens, skip_special=False)})

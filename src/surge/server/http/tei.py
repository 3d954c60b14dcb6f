"""The Hugging Face Inference / text-embeddings-inference (TEI) routes.

POST /  (and POST /models/{name})  dispatches on the model's task, as TEI and the HF Inference API do:
    embed           {"inputs": str | [str]}            -> [[float]] (bare nested array)
                    {"inputs": {"source_sentence", "sentences"}} -> [float] (cosine similarity)
    classify        {"inputs": str | [str], "parameters": {"top_k", "function_to_apply"}}
                                                       -> [[{"label", "score"}]] per input, best first
    rerank          {"inputs": {"text", "text_pair"} | [...]} -> [[{"label", "score"}]];
                    {"inputs": {"source_sentence", "sentences"}} -> [float] (cross-encoder scores)
    token-classify  {"inputs": str | [str], "parameters": {"aggregation_strategy", "ignore_labels"}}
                                                       -> entities (a list per input for a list)
POST /predict   TEI: {"inputs": str | [str, str] (a pair) | [str | [str, str]], "raw_scores", "truncate",
                     "truncation_direction"}
POST /rerank    TEI: {"query", "texts", "raw_scores", "return_text", "truncate", "truncation_direction"}
                -> [{"index", "score", "text"?}];
                a body with "documents" is the Cohere / Jina shape that vLLM's /rerank takes (server/http/rerank.py)
POST /tokenize  TEI: {"inputs", "add_special_tokens", "prompt_name"} -> [[{"id", "text", "special", "start", "stop"}]]
                (with a prompt, as /embed would tokenize: the offsets index the prompted text); a body
                with "prompt" or "messages" is vLLM's /tokenize (server/http/vllm_tokenize.py)
POST /decode    TEI: {"ids", "skip_special_tokens"} -> [str]
GET  /info      TEI: model id, type (embedding / classifier / reranker), limits, version

`huggingface_hub.InferenceClient(model="http://HOST:PORT")` posts to "/" (tested for
feature_extraction, text_classification, token_classification, sentence_similarity).
`truncate` defaults to true on these routes, as TEI's (its --auto-truncate defaults to true from v1.9.0);
`"truncate": false` makes a text longer than the model a 422 (TEI's Validation error). `truncation_direction`
(TEI's: "right", its default, or "left"; "Right" and "Left" too) picks the end a too-long text is cut at: "left"
keeps its last tokens (a pair's longer side, cut at its start), [CLS] ... [SEP] still around them. Errors are TEI's
`{"error", "error_type"}` with TEI's statuses (server/tei_errors.py). /similarity and /embed_sparse:
server/http/tei_embeddings.py.
Every body may name a `model` (surge serves several); the default is the first loaded.
"""

from __future__ import annotations

from typing import Any, ClassVar, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from surge import __version__
from surge.errors import EmptyInput, InvalidInput, SurgeError
from surge.server.errors import render
from surge.runtime.entities import check_strategy
from surge.runtime.tasks import TaskRequest
from surge.server.http import fail_fast
from surge.server.http import rerank as rerank_api
from surge.server.http import vllm_tokenize
from surge.server.http.common import ORJSONResponse, checked_body, json_body, parse, validate
from surge.server.http.task_io import (body_schema, check_length, check_pairs, check_texts, entities, label_scores,
                                       rerank_scores, run_task)
from surge.server.http.tei_embeddings import TEXTS_HINT, check_direction, similarity
from surge.server.state import AppState
from surge.types import EmbedOptions

Pair = list[StrictStr]


class InferenceRequest(BaseModel):
    """HF Inference API body (task parameters under `parameters`; TEI's embedding options at the root)."""

    model_config = ConfigDict(extra="forbid")
    union_hints: ClassVar[dict] = {"inputs": (
        'expected a string, a list of strings, a {"text", "text_pair"} object or a list of them, or a '
        '{"source_sentence", "sentences"} object (texts, not token ids)')}
    inputs: Union[StrictStr, list[Union[StrictStr, dict[str, StrictStr]]], dict[str, Any]]
    parameters: dict[str, Any] | None = None
    model: StrictStr | None = None
    normalize: StrictBool | None = None
    truncate: StrictBool | None = None
    truncation_direction: StrictStr | None = None
    prompt_name: StrictStr | None = None
    dimensions: StrictInt | None = Field(None, ge=1)


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    union_hints: ClassVar[dict] = {"inputs": "expected a string, a pair of strings [string, string], or a list of "
                                             "strings and pairs (texts, not token ids)"}
    inputs: Union[StrictStr, list[Union[StrictStr, Pair]]]
    raw_scores: StrictBool = False
    truncate: StrictBool = True  # TEI's --auto-truncate default
    truncation_direction: StrictStr | None = None
    model: StrictStr | None = None


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    query: StrictStr
    texts: list[StrictStr]
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    truncate: StrictBool = True  # TEI's --auto-truncate default
    truncation_direction: StrictStr | None = None
    model: StrictStr | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    union_hints: ClassVar[dict] = {"inputs": TEXTS_HINT}
    inputs: Union[StrictStr, list[StrictStr]]
    add_special_tokens: StrictBool = True
    model: StrictStr | None = None
    prompt_name: StrictStr | None = None  # the text tokenized as /embed would embed it, prompt first


class DecodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: Union[fail_fast.items(StrictInt), fail_fast.items(fail_fast.items(StrictInt))]
    skip_special_tokens: StrictBool = True
    model: StrictStr | None = None


def _tokenizer(served):
    """(tokenizers.Tokenizer, vocabulary size) of a served model: an encoder's worker's, a decoder's own."""
    worker = getattr(served, "worker", None)
    tok = getattr(getattr(worker, "tokenizer", None), "backend", None) if worker is not None \
        else getattr(served, "tokenizer", None)
    if tok is None:
        raise InvalidInput(f"model '{served.name}' has no tokenizer", param="model")
    return tok, (worker.tokenizer.vocab_size if worker is not None else tok.get_vocab_size())


# TEI's /info writes its DType as "float32", "float16", "bfloat16"; surge's engines say fp32, fp16, bf16 (a
# decoder's, torch's name, is already TEI's); others (fp8) pass as they are
_TEI_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _tei_dtype(dtype: str | None) -> str | None:
    return _TEI_DTYPES.get(dtype, dtype)


def _generate_info(served, limits) -> dict:
    """TEI's /info of a decoder model (TEI itself serves none): its limits and the generation settings."""
    cfg = served.config
    meta = served.kserve_metadata([])
    caps = getattr(getattr(served, "engine", None), "capabilities", None)  # a Ray replica's stand-in has none
    return {"model_id": served.name, "model_sha": None, "model_dtype": _tei_dtype(getattr(caps, "dtype", None)),
            "task": "generate",
            "model_type": {"generate": {"chat_template": served.chat_template is not None,
                                        "tool_call_parser": cfg.tool_call_parser,
                                        "reasoning_parser": cfg.reasoning_parser}},
            "architecture": getattr(served, "architecture", None), "platform": meta["platform"],
            "max_concurrent_requests": cfg.max_waiting, "max_input_length": served.max_model_len,
            "max_batch_tokens": cfg.max_num_batched_tokens, "max_client_batch_size": limits.max_inputs_per_request,
            "tokenization_workers": 1, "version": __version__, "sha": None, "docker_label": None}


def router(state: AppState) -> APIRouter:
    r = APIRouter()
    limits = state.config.limits
    registry = state.registry

    # ------------------------------------------------------------------ POST /
    async def dispatch(request: Request, name: str | None):
        req = await parse(request, InferenceRequest, limits.max_body_bytes)
        served = registry.get(name or req.model)
        params = dict(req.parameters or {})
        task = getattr(served, "task", "embed")
        inputs = req.inputs
        # at the root (TEI's /embed body) or under parameters (its /similarity body, the HF Inference API's)
        direction = check_direction(req.truncation_direction if req.truncation_direction is not None
                                    else params.get("truncation_direction"))
        truncate = req.truncate if req.truncate is not None else params.get("truncate", True)
        if not isinstance(truncate, bool):  # bool("false") is True: a string is refused, not read
            raise InvalidInput("parameters.truncate must be true or false", param="truncate")
        if isinstance(inputs, dict) and "source_sentence" in inputs:
            return ORJSONResponse(await similarity(state, served, inputs, truncate, req.prompt_name,
                                                   direction=direction))
        if task == "embed":
            texts = check_texts([inputs] if isinstance(inputs, str) else _strings(inputs), "inputs", limits)
            result = await state.run(served, texts=texts, options=EmbedOptions(
                normalize=req.normalize if req.normalize is not None else True, truncate=truncate,
                dimensions=req.dimensions, prompt_name=req.prompt_name, truncation_direction=direction))
            return ORJSONResponse(result.vectors, headers={"x-surge-model-version": result.version})
        if task == "token-classify":
            single = isinstance(inputs, str)
            texts = check_texts([inputs] if single else _strings(inputs), "inputs", limits)
            strategy = check_strategy(params.get("aggregation_strategy"))
            ignore = params.get("ignore_labels")
            if ignore is not None and not (isinstance(ignore, list) and all(isinstance(x, str) for x in ignore)):
                raise InvalidInput("parameters.ignore_labels must be a list of label names", param="ignore_labels")
            result = await run_task(state, served, TaskRequest(texts=texts, truncate=truncate,
                                                                       truncation_direction=direction),
                                    "token-classify")
            ents = entities(served, texts, result, strategy, ignore)
            return ORJSONResponse(ents[0] if single else ents)
        top_k = params.get("top_k")
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
            raise InvalidInput("parameters.top_k must be a positive integer", param="top_k")
        function = params.get("function_to_apply")
        if function not in (None, "softmax", "sigmoid", "none"):
            raise InvalidInput("parameters.function_to_apply must be softmax, sigmoid or none",
                               param="function_to_apply")
        if task == "rerank" or (isinstance(inputs, dict) or isinstance(inputs, list) and inputs
                                and isinstance(inputs[0], dict)):
            items = [inputs] if isinstance(inputs, dict) else inputs
            pairs = check_pairs([_text_pair(x, i) for i, x in enumerate(items)], "inputs", limits)
            result = await run_task(state, served, TaskRequest(pairs=pairs, truncate=truncate,
                                                               truncation_direction=direction), "classify", "rerank")
        else:
            texts = check_texts([inputs] if isinstance(inputs, str) else _strings(inputs), "inputs", limits)
            result = await run_task(state, served, TaskRequest(texts=texts, truncate=truncate,
                                                               truncation_direction=direction), "classify")
        return ORJSONResponse(label_scores(result, top_k=top_k, function=function))

    @r.post("/", openapi_extra=body_schema(InferenceRequest))
    async def root(request: Request):
        return await dispatch(request, None)

    @r.post("/models/{name}", openapi_extra=body_schema(InferenceRequest))
    async def named(name: str, request: Request):
        return await dispatch(request, name)

    # ------------------------------------------------------------------ TEI routes
    @r.post("/predict", openapi_extra=body_schema(PredictRequest))
    async def predict(request: Request):
        req = await parse(request, PredictRequest, limits.max_body_bytes)
        direction = check_direction(req.truncation_direction)
        served = registry.get(req.model)
        raw = req.inputs
        # TEI's reading: a string, or a pair [a, b], is one input; anything else a batch of them.
        single = isinstance(raw, str) or (len(raw) == 2 and all(isinstance(x, str) for x in raw))
        items = [raw] if single else list(raw)
        if not items:
            raise EmptyInput("'inputs' must not be empty", param="inputs")
        kinds = {isinstance(x, str) for x in items}
        if len(kinds) > 1:
            raise InvalidInput("'inputs' mixes single texts and pairs", param="inputs")
        if isinstance(items[0], str):
            req_ = TaskRequest(texts=check_texts(items, "inputs", limits), truncate=req.truncate,
                               truncation_direction=direction)
        else:
            req_ = TaskRequest(pairs=check_pairs(items, "inputs", limits), truncate=req.truncate,
                               truncation_direction=direction)
        result = await run_task(state, served, req_, "classify", "rerank")
        out = label_scores(result, raw=req.raw_scores)
        return ORJSONResponse(out[0] if single else out)

    @r.post("/rerank", openapi_extra=body_schema(RerankRequest))
    async def rerank(request: Request):
        body = await json_body(request, limits.max_body_bytes)
        if rerank_api.is_cohere_body(body):  # vLLM's /rerank takes Cohere's body (documents): rerank.py answers
            return await rerank_api.answer(state, validate(rerank_api.CohereRerankRequest, body))
        req = validate(RerankRequest, body)
        direction = check_direction(req.truncation_direction)
        served = registry.get(req.model)
        if not req.query.strip():
            raise InvalidInput("'query' must be a non-empty string", param="query")
        check_length(req.query, "query", limits)
        texts = check_texts(req.texts, "texts", limits)
        result = await run_task(state, served, TaskRequest(pairs=[(req.query, t) for t in texts],
                                                           truncate=req.truncate, param="texts",
                                                           truncation_direction=direction), "rerank")
        scores = rerank_scores(result, raw=req.raw_scores)
        order = sorted(range(len(texts)), key=lambda i: -scores[i])
        return ORJSONResponse([{"index": i, "score": scores[i], **({"text": texts[i]} if req.return_text else {})}
                               for i in order])

    @r.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(request: Request):
        # a large body is decoded, tokenized and answered on a preparation thread (runtime/off_loop.py)
        out = await checked_body(request, tokenized, limits.max_body_bytes)
        if isinstance(out, SurgeError):  # vLLM's body gets vLLM's (OpenAI's) error, not TEI's
            return render(request.url.path, out, tei=False)
        return out

    def tokenized(body):
        """The answer to a decoded /tokenize body, TEI's or vLLM's; vLLM's error returned, not raised."""
        if vllm_tokenize.is_vllm_body(body):  # vLLM's /tokenize shares the path
            try:
                return vllm_tokenize.tokenize(state, body)
            except SurgeError as exc:
                return exc
        req = validate(TokenizeRequest, body)
        served = registry.get(req.model)
        texts = check_texts([req.inputs] if isinstance(req.inputs, str) else req.inputs, "inputs", limits)
        prompted = getattr(served, "prompted", None)  # an embedding model's sentence-transformers prompts
        if prompted is not None:
            texts = prompted(texts, req.prompt_name)
        elif req.prompt_name is not None:
            raise InvalidInput(f"model {served.name} has no sentence-transformers prompts", param="prompt_name")
        tok, _ = _tokenizer(served)
        encs = tok.encode_batch(texts, add_special_tokens=req.add_special_tokens)
        out = []
        for text, e in zip(texts, encs):
            out.append([{"id": i, "text": text[s:t] if not sp else tok.id_to_token(i), "special": bool(sp),
                         "start": None if sp else s, "stop": None if sp else t}
                        for i, sp, (s, t) in zip(e.ids, e.special_tokens_mask, e.offsets)])
        return ORJSONResponse(out)

    @r.post("/decode", openapi_extra=body_schema(DecodeRequest))
    async def decode(request: Request):
        return await checked_body(request, decoded, limits.max_body_bytes)  # as /tokenize

    def decoded(body):
        req = validate(DecodeRequest, body)
        served = registry.get(req.model)
        seqs = [req.ids] if req.ids and isinstance(req.ids[0], int) else req.ids
        if not seqs or any(not s for s in seqs):
            raise EmptyInput("'ids' must be a non-empty list of token ids (or of such lists)", param="ids")
        tok, vocab = _tokenizer(served)
        for i, s in enumerate(seqs):
            if min(s) < 0 or max(s) >= vocab:
                raise InvalidInput(f"ids[{i}] has a token id outside [0, {vocab})", param="ids")
        return ORJSONResponse(tok.decode_batch(seqs, skip_special_tokens=req.skip_special_tokens))

    @r.get("/info")
    async def info(model: str | None = None):
        served = registry.get(model)
        task = getattr(served, "task", "embed")
        if task == "generate":
            return ORJSONResponse(_generate_info(served, limits))
        spec = served.spec
        if task == "embed":
            model_type = {"embedding": {"pooling": spec.pooling}}
        else:
            head = served.tasks.head(getattr(getattr(served, "head", None), "name", None))
            labels = {str(i): l for i, l in enumerate(head.labels)}
            kind = "reranker" if task == "rerank" else "classifier"
            model_type = {kind: {"id2label": labels, "label2id": {l: int(i) for i, l in labels.items()}},
                          "task": task}
        caps = served.worker.engines.capabilities
        return ORJSONResponse({
            "model_id": served.name, "model_sha": None, "model_dtype": _tei_dtype(caps.dtype), "model_type": model_type,
            "task": task, "architecture": spec.task_info.architecture if spec.task_info else None,
            "max_concurrent_requests": served.batching.max_queue_size, "max_input_length": served.max_length,
            "max_batch_tokens": served.batching.max_batch_tokens,
            "max_client_batch_size": limits.max_inputs_per_request, "tokenization_workers": 1,
            "version": __version__, "sha": None, "docker_label": None,
        })

    return r


def _strings(inputs) -> list[str]:
    if not isinstance(inputs, list) or not all(isinstance(x, str) for x in inputs):
        raise InvalidInput("'inputs' must be a string or a list of strings for this model", param="inputs")
    return inputs


def _text_pair(x, i: int):
    if isinstance(x, dict):
        extra = set(x) - {"text", "text_pair"}
        if extra:
            raise InvalidInput(f"inputs[{i}] has unknown keys {sorted(extra)}; expected text and text_pair",
                               param="inputs")
        return [x.get("text"), x.get("text_pair")]
    return x

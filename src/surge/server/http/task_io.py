"""What the task routes (tei.py, rerank.py, KServe) share: input checks, the runtime call, output shapes."""

from __future__ import annotations

import numpy as np

from surge.engines.heads import scores as head_scores
from surge.engines.heads import sigmoid
from surge.errors import EmptyInput, InvalidInput, PayloadTooLarge
from surge.runtime.entities import EntityDecoder
from surge.runtime.tasks import TaskRequest, TaskResult, require_task


def body_schema(model) -> dict:
    """openapi_extra declaring a pydantic model as the JSON request body (routes parse it themselves,
    so that errors get surge's messages)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}}


def check_texts(texts: list[str], field: str, limits) -> list[str]:
    if not texts:
        raise EmptyInput(f"'{field}' must not be empty", param=field)
    if len(texts) > limits.max_inputs_per_request:
        raise PayloadTooLarge(f"'{field}' has {len(texts)} entries, more than the limit of "
                              f"{limits.max_inputs_per_request}", param=field)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InvalidInput(f"{field}[{i}] is not a string", param=field)
        if not t.strip():
            raise EmptyInput(f"{field}[{i}] is empty; expected a non-empty string", param=field)
        if len(t) > limits.max_input_chars:
            raise PayloadTooLarge(f"{field}[{i}] has {len(t)} characters; at most {limits.max_input_chars} "
                                  "are allowed", param=field)
    return texts


def check_length(text: str, field: str, limits) -> str:
    """A rerank query (or a similarity's source sentence) is bounded as the texts it is paired with are:
    unchecked, it costs its length times the number of those texts (cache keys, tokenizing)."""
    if len(text) > limits.max_input_chars:
        raise PayloadTooLarge(f"'{field}' has {len(text)} characters; at most {limits.max_input_chars} are allowed",
                              param=field)
    return text


def check_pairs(pairs: list, field: str, limits) -> list[tuple[str, str]]:
    if not pairs:
        raise EmptyInput(f"'{field}' must not be empty", param=field)
    if len(pairs) > limits.max_inputs_per_request:
        raise PayloadTooLarge(f"'{field}' has {len(pairs)} entries, more than the limit of "
                              f"{limits.max_inputs_per_request}", param=field)
    out = []
    for i, p in enumerate(pairs):
        if not isinstance(p, (list, tuple)) or len(p) != 2 or not all(isinstance(x, str) for x in p):
            raise InvalidInput(f"{field}[{i}] must be a pair of two non-empty strings [text, text_pair]; "
                               "a side is missing", param=field)
        if not all(x.strip() for x in p):
            raise EmptyInput(f"{field}[{i}] has an empty side; expected two non-empty strings [text, text_pair]",
                             param=field)
        for x in p:
            if len(x) > limits.max_input_chars:
                raise PayloadTooLarge(f"{field}[{i}] has a text of {len(x)} characters; at most "
                                      f"{limits.max_input_chars} are allowed", param=field)
        out.append((p[0], p[1]))
    return out


async def run_task(state, served, req: TaskRequest, *tasks: str) -> TaskResult:
    """The runtime call through AppState.call: one deadline (504 past it) and the KServe statistics."""
    require_task(served, *tasks)
    def infer(deadline):
        return state.on_current(served, lambda s: s.infer(req) if deadline is None else s.infer(req, deadline=deadline))

    return await state.call(served, infer)


def label_scores(result: TaskResult, raw: bool = False, top_k: int | None = None,
                 function: str | None = None) -> list[list[dict]]:
    """Per input: [{"label", "score"}] best first (softmax / sigmoid as the head says, or raw logits)."""
    head = result.head
    out = []
    for logits in result.outputs:
        if raw or function == "none":
            sc = np.asarray(logits, dtype=np.float64)
        elif function == "sigmoid":
            sc = sigmoid(logits)
        elif function == "softmax":
            e = np.exp(logits - np.max(logits))
            sc = e / e.sum()
        else:
            sc = head_scores(head, logits)
        order = np.argsort(-sc, kind="stable")
        if top_k is not None:
            order = order[:top_k]
        out.append([{"label": head.labels[k], "score": float(sc[k])} for k in order])
    return out


def rerank_scores(result: TaskResult, raw: bool = False) -> list[float]:
    """One relevance score per pair: the logit, or its sigmoid (as sentence-transformers' CrossEncoder)."""
    vals = [float(np.asarray(o).reshape(-1)[0]) for o in result.outputs]
    return vals if raw else [float(sigmoid(v)) for v in vals]


def entities(served, texts: list[str], result: TaskResult, strategy: str, ignore_labels=None) -> list[list[dict]]:
    decoder = getattr(served, "_entity_decoder", None)
    if decoder is None:
        decoder = EntityDecoder(served.worker.tokenizer.backend)
        try:
            served._entity_decoder = decoder
        except AttributeError:
            pass
    return [decoder.entities(t, enc, logits, result.head.labels, strategy, ignore_labels)
            for t, enc, logits in zip(texts, result.encodings, result.outputs)]

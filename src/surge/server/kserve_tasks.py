"""The KServe v2 tensor contracts of task models (classify, rerank, token-classify).

  classify        in   text       BYTES [N] or [N,1]
                  out  logits     FP32  [N, labels]
  rerank          in   text       BYTES [N]   (the query, or one query per pair)
                       text_pair  BYTES [N]   (the documents)
                  out  logits     FP32  [N, 1]   (the cross-encoder's raw score; sigmoid gives CrossEncoder's)
  token-classify  in   text       BYTES [N]
                  out  logits     FP32  [N, L, labels]  (L: the longest input's tokens, special tokens
                                                        included; rows past an input's length are 0)
                       lengths    INT64 [N]             (tokens of each input)

Request parameters: truncate (bool, default true). The labels' names are in
GET /info. Both protocol layers call `infer` and encode what it returns.

Triton's classification extension (server/kserve_classification.py): `logits` requested with the
parameter classification = k comes back as BYTES [N, k] "<value>:<index>:<label>" (classify, rerank);
token-classify's rows are tokens, not inputs, so it is refused there.
"""

from __future__ import annotations

import numpy as np

from surge.errors import InvalidInput, SurgeError
from surge.runtime.tasks import TaskRequest
from surge.server.http.openai import split_input
from surge.server.kserve_contract import InputTensor, _param, platform

TEXT, TEXT_PAIR, LOGITS, LENGTHS = "text", "text_pair", "logits", "lengths"


def metadata(service, versions: list[str]) -> dict:
    task = service.task
    head = service.tasks.head(getattr(getattr(service, "head", None), "name", None))
    labels = len(head.labels)
    inputs = [{"name": TEXT, "datatype": "BYTES", "shape": [-1]}]
    if task == "rerank":
        inputs.append({"name": TEXT_PAIR, "datatype": "BYTES", "shape": [-1]})
    if task == "token-classify":
        outputs = [{"name": LOGITS, "datatype": "FP32", "shape": [-1, -1, labels]},
                   {"name": LENGTHS, "datatype": "INT64", "shape": [-1]}]
    else:
        outputs = [{"name": LOGITS, "datatype": "FP32", "shape": [-1, labels]}]
    return {"name": service.name, "versions": versions,
            "platform": platform(service), "inputs": inputs, "outputs": outputs}


def _strings(t: InputTensor, max_inputs: int, max_chars: int) -> list[str]:
    if t.datatype != "BYTES":
        raise InvalidInput(f"input '{t.name}' must have datatype BYTES, got {t.datatype}", param=t.name)
    if not (len(t.shape) == 1 or (len(t.shape) == 2 and t.shape[1] == 1)):
        raise InvalidInput(f"input '{t.name}' must have shape [N] or [N,1], got {list(t.shape)}", param=t.name)
    try:
        texts = [raw.decode("utf-8") for raw in t.values]
    except UnicodeDecodeError:
        raise InvalidInput(f"input '{t.name}' holds invalid UTF-8", param=t.name) from None
    try:
        return split_input(texts, max_inputs, max_chars)[0]
    except SurgeError as exc:
        raise type(exc)(exc.message.replace("'input'", f"'{t.name}'").replace("input ", f"'{t.name}' element "),
                        param=t.name) from None


def decode(service, tensors: list[InputTensor], params: dict, outputs: list[tuple[str, dict]], limits) -> TaskRequest:
    task = service.task
    allowed = {TEXT, TEXT_PAIR} if task == "rerank" else {TEXT}
    by_name = {}
    for t in tensors:
        if t.name in by_name:
            raise InvalidInput(f"input '{t.name}' is given twice")
        if t.name not in allowed:
            raise InvalidInput(f"unexpected input '{t.name}': model '{service.name}' (task {task}) takes "
                               f"{' and '.join(sorted(allowed))} (BYTES [N])", param=t.name)
        by_name[t.name] = t
    missing = sorted(allowed - set(by_name))
    if missing:
        raise InvalidInput(f"missing input '{missing[0]}': model '{service.name}' (task {task}) takes "
                           f"{' and '.join(sorted(allowed))} (BYTES [N])", param=missing[0])
    names = {LOGITS, LENGTHS} if task == "token-classify" else {LOGITS}
    for name, _ in outputs:
        if name not in names:
            raise InvalidInput(f"unknown output '{name}': this model's outputs are {', '.join(sorted(names))}")
    truncate = _param(params, "truncate", bool, True)
    texts = _strings(by_name[TEXT], limits.max_inputs_per_request, limits.max_input_chars)
    if task != "rerank":
        return TaskRequest(texts=texts, truncate=truncate, param=TEXT)
    pairs = _strings(by_name[TEXT_PAIR], limits.max_inputs_per_request, limits.max_input_chars)
    if len(texts) == 1 and len(pairs) > 1:
        texts = texts * len(pairs)  # one query against N documents
    if len(texts) != len(pairs):
        raise InvalidInput(f"'text' has {len(texts)} elements and 'text_pair' {len(pairs)}: send one query, "
                           "or one per pair", param=TEXT_PAIR)
    return TaskRequest(pairs=list(zip(texts, pairs)), truncate=truncate, param=TEXT_PAIR)


def encode(result) -> list[tuple[str, str, np.ndarray]]:
    """(name, datatype, array) per output."""
    outs = result.outputs
    if result.head.task != "token-classify":
        return [(LOGITS, "FP32", np.ascontiguousarray(np.stack(outs), dtype=np.float32))]
    lengths = np.array([o.shape[0] for o in outs], dtype=np.int64)
    logits = np.zeros((len(outs), int(lengths.max()), outs[0].shape[1]), dtype=np.float32)
    for i, o in enumerate(outs):
        logits[i, :len(o)] = o
    return [(LOGITS, "FP32", logits), (LENGTHS, "INT64", lengths)]


async def infer(state, service, tensors, params, outputs, limits):
    from surge.server.http.task_io import run_task
    from surge.server import kserve_classification as classification

    req = decode(service, tensors, params, outputs, limits)
    wanted = classification.counts(outputs)  # checked before the model runs
    if wanted and service.task == "token-classify":
        raise InvalidInput(f"classification is not available for model '{service.name}' (task token-classify): "
                           "its logits hold a row per token, not per input", param=classification.PARAM)
    result = await run_task(state, service, req, service.task)
    return result, classification.apply(encode(result), wanted, list(result.head.labels), batched=True)

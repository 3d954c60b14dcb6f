"""Triton's `config.pbtxt` (protobuf text format of ModelConfig) as a surge model.yaml.

Only the fields that have a meaning in surge are mapped (name, platform /
backend, max_batch_size, input / output, dynamic_batching, instance_group,
parameters, default_model_filename); the others are listed in `ignored` so the
loader can say what it did not honour. The parser is a small reader of the
text format (scalars, messages in braces, lists in brackets, comments) so that
models/ needs no protobuf descriptors from server/.
"""

from __future__ import annotations

import re
from pathlib import Path

from surge.errors import ConfigError

_TOKEN = re.compile(r'\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|[{}\[\]:,;<>]|[^\s{}\[\]:,;<>"\'#]+')
_BACKENDS = {"onnxruntime": "onnx", "python": "python", "pytorch": "torch"}
_PLATFORMS = {"onnxruntime_onnx": "onnx", "torch_export": "torch", "pytorch_libtorch": "torch"}
MAPPED = {"name", "platform", "backend", "max_batch_size", "input", "output", "dynamic_batching",
          "instance_group", "parameters", "default_model_filename"}


def parse_text_proto(text: str, where: str = "config.pbtxt") -> dict:
    """Text format -> dict; a repeated field (or a [list]) becomes a list."""
    tokens = [t for t in _TOKEN.findall(text) if t.strip() and not t.startswith("#")]
    pos = 0

    def fail(msg: str):
        raise ConfigError(f"{where}: {msg}")

    def value(tok: str):
        if tok[0] in "\"'":
            return bytes(tok[1:-1], "utf-8").decode("unicode_escape")
        if re.fullmatch(r"[-+]?\d+", tok):
            return int(tok)
        try:
            return float(tok)
        except ValueError:
            return {"true": True, "false": False}.get(tok, tok)  # enum names stay strings

    def message(close: str | None) -> dict:
        nonlocal pos
        out: dict = {}
        while pos < len(tokens):
            tok = tokens[pos]
            if tok in (",", ";"):
                pos += 1
                continue
            if tok == close:
                pos += 1
                return out
            key = tok
            pos += 1
            if pos < len(tokens) and tokens[pos] == ":":
                pos += 1
            if pos >= len(tokens):
                fail(f"field '{key}' has no value")
            got = item()
            if key in out:
                prev = out[key]
                out[key] = (prev if isinstance(prev, list) else [prev]) + (got if isinstance(got, list) else [got])
            else:
                out[key] = got
        if close is not None:
            fail(f"missing '{close}' at the end")
        return out

    def item():
        nonlocal pos
        tok = tokens[pos]
        if tok in ("{", "<"):
            pos += 1
            return message("}" if tok == "{" else ">")
        if tok == "[":
            pos += 1
            items = []
            while pos < len(tokens) and tokens[pos] != "]":
                if tokens[pos] == ",":
                    pos += 1
                    continue
                items.append(item())
            if pos >= len(tokens):
                fail("missing ']'")
            pos += 1
            return items
        pos += 1
        return value(tok)

    return message(None)


def _list(v) -> list:
    return v if isinstance(v, list) else [] if v is None else [v]


def model_file_dict(path: Path) -> tuple[dict, list[str]]:
    """A config.pbtxt as the dict of a model.yaml (ModelFile), and the fields not mapped."""
    try:
        cfg = parse_text_proto(Path(path).read_text(encoding="utf-8"), str(path))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
    backend, platform = cfg.get("backend", ""), cfg.get("platform", "")
    kind = _BACKENDS.get(backend) or _PLATFORMS.get(platform)
    if kind is None:
        raise ConfigError(f"{path}: field 'backend': surge serves backend onnxruntime, python or pytorch "
                          f"(platform onnxruntime_onnx or torch_export), got backend {backend!r} platform {platform!r}",
                          param="backend")

    def tensors(field: str) -> list[dict]:
        out = []
        for t in _list(cfg.get(field)):
            if not isinstance(t, dict) or "name" not in t or "data_type" not in t:
                raise ConfigError(f"{path}: field '{field}': each entry needs name and data_type", param=field)
            d = {"name": t["name"], "datatype": t["data_type"], "dims": [int(x) for x in _list(t.get("dims"))]}
            if "reshape" in t:
                d["dims"] = [int(x) for x in _list((t["reshape"] or {}).get("shape"))]  # what surge serves
            if t.get("optional"):
                d["optional"] = True
            out.append(d)
        return out

    tensor: dict = {"max_batch_size": int(cfg.get("max_batch_size", 0))}
    if "input" in cfg:
        tensor["inputs"] = tensors("input")
    if "output" in cfg:
        tensor["outputs"] = tensors("output")
    if cfg.get("default_model_filename"):
        tensor["file"] = cfg["default_model_filename"]
    params = {}
    for p in _list(cfg.get("parameters")):
        if isinstance(p, dict) and "key" in p:
            v = p.get("value", {})
            params[p["key"]] = v.get("string_value", "") if isinstance(v, dict) else v
    if params:
        tensor["parameters"] = params
    out: dict = {"kind": kind, "tensor": tensor, "description": f"from {Path(path).name}"}
    if "dynamic_batching" in cfg:
        db = cfg["dynamic_batching"] if isinstance(cfg["dynamic_batching"], dict) else {}
        batching = {"enabled": True}
        if "max_queue_delay_microseconds" in db:
            batching["max_queue_delay_ms"] = int(db["max_queue_delay_microseconds"]) / 1000.0
        if tensor["max_batch_size"] > 0:
            batching["max_batch_size"] = tensor["max_batch_size"]
        out["batching"] = batching
    elif tensor["max_batch_size"] > 0:
        # Triton without dynamic_batching runs each request as it comes (batched only by the client).
        out["batching"] = {"enabled": False}
    groups = _list(cfg.get("instance_group"))
    if groups:
        g = groups[0] if isinstance(groups[0], dict) else {}
        engine: dict = {"instances": int(g.get("count", 1))}
        if g.get("kind") == "KIND_GPU":
            gpus = _list(g.get("gpus"))
            engine["device"] = f"cuda:{int(gpus[0])}" if gpus else "cuda"
        out["engine"] = engine
    return out, sorted(set(cfg) - MAPPED)


def load_model_file(path: Path, merge_with: dict | None = None):
    """A config.pbtxt validated as a ModelFile; a ConfigError names the file and field."""
    from pydantic import ValidationError

    from surge.config import ModelFile, _deep_merge

    data, ignored = model_file_dict(path)
    if ignored:
        import logging

        logging.getLogger("surge.repository").warning("%s: fields not used by surge: %s", path, ", ".join(ignored))
        data["description"] = f"from {Path(path).name} (not used: {', '.join(ignored)})"
    try:
        return ModelFile.model_validate(_deep_merge(merge_with or {}, data))
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ())) or "(top level)"
        raise ConfigError(f"{path}: field '{field}': {err.get('msg', 'invalid')}", param=field) from None

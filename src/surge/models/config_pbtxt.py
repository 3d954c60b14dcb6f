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


_ESCAPES = {"n": b"\n", "t": b"\t", "r": b"\r", "a": b"\a", "b": b"\b", "f": b"\f", "v": b"\v", "\\": b"\\",
            "'": b"'", '"': b'"', "?": b"?"}
_ESCAPE = re.compile(r"\\(?:([0-7]{1,3})|[xX]([0-9a-fA-F]{1,2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|(.)|$)", re.DOTALL)


def _unescape(body: str) -> str:
    """A quoted string's body with the text format's escapes decoded. An octal or hex escape is one
    byte and the result is UTF-8 (as protobuf reads it); text outside escapes is kept as it is
    (unicode_escape would read UTF-8 text as Latin-1: "naïve" -> "naÃ¯ve")."""
    out = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(body):
        out += body[pos:m.start()].encode("utf-8")
        pos = m.end()
        octal, hexa, u4, u8, char = m.groups()
        if octal or hexa:
            byte = int(octal, 8) if octal else int(hexa, 16)
            if byte > 0xFF:
                raise ValueError(f"invalid escape '{m.group(0)}'")
            out.append(byte)
        elif u4 or u8:
            try:
                out += chr(int(u4 or u8, 16)).encode("utf-8")
            except (ValueError, UnicodeEncodeError):
                raise ValueError(f"invalid escape '{m.group(0)}'") from None
        elif char in _ESCAPES:
            out += _ESCAPES[char]
        else:
            raise ValueError(f"invalid escape '{m.group(0)}'")
    out += body[pos:].encode("utf-8")
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"string \"{body}\" is not valid UTF-8") from None


def parse_text_proto(text: str, where: str = "config.pbtxt") -> dict:
    """Text format -> dict; a repeated field (or a [list]) becomes a list."""
    tokens = [t for t in _TOKEN.findall(text) if t.strip() and not t.startswith("#")]
    pos = 0

    def fail(msg: str):
        raise ConfigError(f"{where}: {msg}")

    def value(tok: str):
        if tok[0] in "\"'":
            try:
                return _unescape(tok[1:-1])
            except ValueError as exc:
                fail(str(exc))
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
    kind = _BACKENDS.get(backend if isinstance(backend, str) else "") or \
        _PLATFORMS.get(platform if isinstance(platform, str) else "")  # a message given is not a name
    if kind is None:
        raise ConfigError(f"{path}: field 'backend': surge serves backend onnxruntime, python or pytorch "
                          f"(platform onnxruntime_onnx or torch_export), got backend {backend!r} platform {platform!r}",
                          param="backend")

    def integer(value, field: str) -> int:
        # Text format integers only: int() would raise ValueError ('abc'), OverflowError (1e400) or
        # TypeError (a list), or truncate a float, where a ConfigError must name the field.
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: field '{field}': expected an integer, got {value!r}", param=field)

    def tensors(field: str) -> list[dict]:
        out = []
        for t in _list(cfg.get(field)):
            if not isinstance(t, dict) or "name" not in t or "data_type" not in t:
                raise ConfigError(f"{path}: field '{field}': each entry needs name and data_type", param=field)
            d = {"name": t["name"], "datatype": t["data_type"],
                 "dims": [integer(x, f"{field}.dims") for x in _list(t.get("dims"))]}
            if "reshape" in t:
                d["dims"] = [integer(x, f"{field}.reshape.shape")
                             for x in _list((t["reshape"] or {}).get("shape"))]  # what surge serves
            if t.get("optional"):
                d["optional"] = True
            out.append(d)
        return out

    max_batch = integer(cfg.get("max_batch_size", 0), "max_batch_size")
    if not 0 <= max_batch <= 2**31 - 1:  # Triton's int32 field; checked here to name the field as this file does
        raise ConfigError(f"{path}: field 'max_batch_size': {max_batch} is outside 0..2147483647 "
                          "(0: the model does not batch)", param="max_batch_size")
    tensor: dict = {"max_batch_size": max_batch}
    if "input" in cfg:
        tensor["inputs"] = tensors("input")
    if "output" in cfg:
        tensor["outputs"] = tensors("output")
    if cfg.get("default_model_filename"):
        tensor["file"] = cfg["default_model_filename"]
    params = {}
    for p in _list(cfg.get("parameters")):
        if isinstance(p, dict) and "key" in p:
            if not isinstance(p["key"], str):
                raise ConfigError(f"{path}: field 'parameters.key': expected a string, got {p['key']!r}",
                                  param="parameters")
            v = p.get("value", {})
            params[p["key"]] = v.get("string_value", "") if isinstance(v, dict) else v
    if params:
        tensor["parameters"] = params
    out: dict = {"kind": kind, "tensor": tensor, "description": f"from {Path(path).name}"}
    if "dynamic_batching" in cfg:
        db = cfg["dynamic_batching"] if isinstance(cfg["dynamic_batching"], dict) else {}
        batching = {"enabled": True}
        if "max_queue_delay_microseconds" in db:
            batching["max_queue_delay_ms"] = integer(db["max_queue_delay_microseconds"],
                                                  "dynamic_batching.max_queue_delay_microseconds") / 1000.0
        if tensor["max_batch_size"] > 0:
            batching["max_batch_size"] = tensor["max_batch_size"]
        out["batching"] = batching
    elif tensor["max_batch_size"] > 0:
        # Triton without dynamic_batching runs each request as it comes (batched only by the client).
        out["batching"] = {"enabled": False}
    groups = _list(cfg.get("instance_group"))
    if groups:
        g = groups[0] if isinstance(groups[0], dict) else {}
        engine: dict = {"instances": integer(g.get("count", 1), "instance_group.count")}
        if g.get("kind") == "KIND_GPU":
            gpus = _list(g.get("gpus"))
            engine["device"] = f"cuda:{integer(gpus[0], 'instance_group.gpus')}" if gpus else "cuda"
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

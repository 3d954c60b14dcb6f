"""A generation request's structured-output fields -> one guide (runtime/guided.py).

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema":
...}}), vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and its newer
`structured_outputs` object ({"json" | "regex" | "choice" | "grammar": ..., or "json_object": true}); and a
chat request's `tool_choice` "required" or a named function, which becomes a grammar of calls in the
model's tool-call parser's format (server/http/tool_parsers/: hermes `<tool_call>` blocks, llama3_json
objects, a mistral `[TOOL_CALLS]` array) whose arguments follow the tools' parameter schemas. At most one
constraint a request; each is checked against the model's tokenizer here, so a bad schema is a 400 that
names the field it came in.
"""

from __future__ import annotations

import json

from surge.errors import InvalidInput
from surge.runtime.guided import ANY_OBJECT, JSON_STYLE, guide_for
from surge.server.http import tool_parsers

VLLM_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar"}
FIELDS = ("response_format", *VLLM_FIELDS, "structured_outputs")


def guide_from_dict(fields: dict, service) -> tuple[str, str] | None:
    """request_guide over a dict of parameters (KServe's generate parameters, Triton's sampling_parameters)."""
    from types import SimpleNamespace

    return request_guide(SimpleNamespace(**{f: fields.get(f) for f in FIELDS}), service)


def asks_guide(req) -> bool:
    """Whether a request (OpenAI's fields, as request_guide reads them) may carry a guide: a structured-output
    field set, or a tool choice that forces calls."""
    if any(getattr(req, f, None) is not None for f in FIELDS):
        return True
    return getattr(req, "tool_choice", None) not in (None, "none", "auto") and bool(getattr(req, "tools", None))


def request_guide(req, service, tool_guide: tuple[str, str] | None = None) -> tuple[str, str] | None:
    """The request's guide (None: unconstrained), checked against the model; `tool_guide`: the guide a
    forced tool choice asks for (tool_choice_guide)."""
    found: list[tuple[str, tuple[str, str]]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidInput("response_format must be an object", param="response_format")
    if fmt:
        kind = fmt.get("type", "text")
        if kind == "json_object":
            found.append(("response_format", ("json", ANY_OBJECT)))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise InvalidInput("response_format 'json_schema' needs json_schema.schema", param="response_format")
            found.append(("response_format", guide_for("json", spec["schema"], "response_format")))
        elif kind != "text":
            raise InvalidInput(f"response_format type '{kind}' is not one of text, json_object, json_schema",
                               param="response_format")
    for field, kind in VLLM_FIELDS.items():
        value = getattr(req, field, None)
        if value is not None:
            found.append((field, guide_for(kind, value, field)))
    so = getattr(req, "structured_outputs", None)
    if so:
        if not isinstance(so, dict):
            raise InvalidInput("structured_outputs must be an object", param="structured_outputs")
        for key, value in so.items():
            if key == "json_object":
                if value:
                    found.append(("structured_outputs", ("json", ANY_OBJECT)))
            elif key in ("json", "regex", "choice", "grammar"):
                if value is not None:
                    found.append(("structured_outputs", guide_for(key, value, "structured_outputs")))
            elif value is not None:
                raise InvalidInput(f"structured_outputs.{key} is not supported (json, regex, choice, grammar, "
                                   "json_object)", param="structured_outputs")
    if tool_guide is not None:
        found.append(("tool_choice", tool_guide))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidInput("one structured-output constraint a request; got " + ", ".join(f for f, _ in found),
                           param=found[1][0])
    param, guide = found[0]
    service.check_guide(guide, param)
    return guide


def tool_choice_guide(tools: list[dict], choice, literal=json.dumps, parallel: bool = True,
                      parser: str = "hermes") -> tuple[str, str]:
    """A grammar for tool_choice "required" (one or more calls of any of `tools`; one with `parallel`
    false, OpenAI's parallel_tool_calls) or a named function (one call of it), in the format the
    tool-call parser `parser` reads (server/http/tool_parsers/); `literal`: the tags as the model writes
    them (the service's guide_literal: one special token or text)."""
    spec = tool_parsers.get(parser)
    by_name = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidInput("each tool needs function.name", param="tools")
        by_name[fn["name"]] = fn.get("parameters") or {"type": "object"}
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in by_name:
            raise InvalidInput(f"tool_choice names '{name}', which is not among the tools", param="tool_choice")
        names, many = [name], False
    else:
        names, many = list(by_name), parallel
    key = spec.args_key
    calls = [{"type": "object", "properties": {"name": {"const": n}, key: by_name[n]},
              "required": ["name", key], "additionalProperties": False} for n in names]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    body = "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})
    return "grammar", spec.grammar(many, literal) + f"body: {body}\n"

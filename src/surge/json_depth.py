"""A bound on how deeply nested the JSON of a request may be.

orjson parses up to 1024 levels, but parts of a body go on to code that recurses in Python: json.dumps
when a JSON schema becomes a guide, a chat template's `tojson`, json.loads of a schema or a tool call's
arguments sent as a string. From ~990 levels those raised RecursionError (a 500 and a traceback per
request). No real schema, tool definition or tensor comes near MAX_DEPTH.
"""

from __future__ import annotations

import json

from surge.errors import InvalidInput

MAX_DEPTH = 128


def too_deep(value, limit: int = MAX_DEPTH) -> bool:
    """Whether `value` (decoded JSON) nests lists and objects more than `limit` levels. Iterative: the
    check must not recurse itself."""
    if not isinstance(value, (list, dict)):
        return False
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in (node.values() if isinstance(node, dict) else node):
            if isinstance(child, (list, dict)):
                stack.append((child, depth + 1))
    return False


def check_body(body: bytes | str, value) -> None:
    """InvalidInput when a decoded request body nests deeper than MAX_DEPTH. Counting the brackets (at C
    speed) bounds the depth from above, so the walk runs only for bodies with many of them."""
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return
    if too_deep(value):
        raise InvalidInput(f"the JSON is nested more than {MAX_DEPTH} levels deep")


def loads(text: str | bytes):
    """json.loads of JSON that a request carries as a string (a schema, tool call arguments): ValueError
    when it is not JSON or is nested more than MAX_DEPTH levels (a RecursionError of the parser
    included), as for any invalid JSON."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep") from None
    if too_deep(value):
        raise ValueError(f"JSON nested more than {MAX_DEPTH} levels deep")
    return value

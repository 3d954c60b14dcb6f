"""Request validation errors that cost about what the body weighs, because the routes report only the first.

pydantic collects every error of a body before raising: a 2 MB body of 650,000 `{}` items for a field
that is a union of four list types made ~2.6 million errors (7 s of CPU, +2 GB of memory for one
request), and one of 180,000 unknown keys 180,000 errors.

- Unknown top-level keys of a model that forbids them are found with a set difference first.
- A body larger than PRECHECK_BYTES is first checked by a fail-fast twin of its model: the model's own
  core schema with every list, tuple, set and dict marked `fail_fast` (the rest of a collection is not
  looked at once an item fails). Models inside it are replaced by their fields' schemas, because
  pydantic-core reuses a model class's own, prebuilt validator wherever the class appears (it would
  ignore the marks), and validators that run after a model is built are left out (they only see valid
  data). The twin only finds errors; a body it passes is validated by the model itself, as before.
- A union's list choices are `items(...)`: marked fail_fast in the model itself, because pydantic validates a
  value against each choice of a union and discards the errors of those that refuse it, so a *valid* body paid
  for them too (the twin runs before, and only finds errors of bodies that have them).
"""

from __future__ import annotations

import copy
from contextvars import ContextVar
from functools import lru_cache
from typing import Annotated

from pydantic import Field, ValidationError
from pydantic_core import SchemaValidator

PRECHECK_BYTES = 16 * 1024  # below: at most a few thousand items, a few MB of errors at worst
# The size of the body this task decoded last (common.decode_json sets it): a context variable, so that
# routes that decode and validate in steps of their own need no extra argument. Unset: checked as large.
BODY_SIZE: ContextVar[int | None] = ContextVar("surge_body_size", default=None)
_COLLECTIONS = frozenset({"list", "tuple", "set", "frozenset", "dict"})
_VALUES = frozenset({"default", "metadata", "serialization", "expected", "config", "cls"})  # not schemas


def _twin(node):
    """A copy of a core schema with collections fail-fast and models as their fields (iterative rewrite)."""
    def unwrap(n):
        while isinstance(n, dict):
            if n.get("type") == "model":  # its fields' schema, keeping the ref that definitions point at
                inner = dict(n["schema"])
                if "ref" in n:
                    inner["ref"] = n["ref"]
                n = inner
            elif n.get("type") == "function-after":  # runs on valid data only: nothing to find there
                inner = dict(n["schema"])
                if "ref" in n and "ref" not in inner:
                    inner["ref"] = n["ref"]
                n = inner
            else:
                return n
        return n

    root = unwrap(copy.deepcopy(node))
    stack = [root]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            kind = n.get("type")  # a str in a schema; in a model's `fields` mapping, maybe a field named "type"
            if isinstance(kind, str) and kind in _COLLECTIONS:
                n["fail_fast"] = True
            for k, v in list(n.items()):
                if k in _VALUES:
                    continue
                if isinstance(v, dict):
                    v = n[k] = unwrap(v)
                elif isinstance(v, list):  # a union's choices may be (schema, label) pairs
                    v[:] = [(unwrap(x[0]), *x[1:]) if isinstance(x, tuple) and x else unwrap(x) for x in v]
                    stack.extend(x[0] for x in v if isinstance(x, tuple) and x)
                stack.append(v)
        elif isinstance(n, list):
            stack.extend(n)
    return root


def items(item):
    """list[item] whose validation stops at its first bad item (the first error, which the routes report, is
    the one it would have been). For a union's list choices: a valid prompt of 900,000 token ids made 900,000
    errors in the list-of-strings choice before the ids' choice took it, ~180 ms of native code holding the GIL
    (and with it the event loop, benchmarks/loop_stall.py); now one."""
    return Annotated[list[item], Field(fail_fast=True)]


@lru_cache(maxsize=None)
def precheck(model) -> SchemaValidator | None:
    """The fail-fast twin of `model`, or None where one cannot be built (then pydantic alone decides)."""
    try:
        return SchemaValidator(_twin(model.__pydantic_core_schema__))
    except Exception:  # noqa: BLE001 - a schema this does not understand: no precheck, as before
        return None


@lru_cache(maxsize=None)
def known_keys(model) -> frozenset[str] | None:
    """The top-level keys `model` takes where it forbids others; None where it allows them, or where
    an alias is not a plain name (then pydantic alone decides)."""
    if model.model_config.get("extra") != "forbid":
        return None
    keys = set()
    for name, field in model.model_fields.items():
        keys.add(name)
        for alias in (field.alias, field.validation_alias):
            if alias is None:
                continue
            if not isinstance(alias, str):
                return None
            keys.add(alias)
    return frozenset(keys)


def first_missing(model, data: dict) -> str | None:
    """The first required field of `model` (in its order) that `data` lacks under its name and aliases."""
    for name, field in model.model_fields.items():
        if field.is_required() and not any(k in data for k in (name, field.alias, field.validation_alias)
                                           if isinstance(k, str)):
            return field.alias if isinstance(field.alias, str) else name
    return None


def check(model, data) -> None:
    """ValidationError with the first error(s) of a body larger than PRECHECK_BYTES that `model` would
    refuse; nothing where it would take it (the model itself then validates it, as before)."""
    size = BODY_SIZE.get()
    if size is not None and size <= PRECHECK_BYTES:
        return
    twin = precheck(model)
    if twin is None:
        return
    try:
        twin.validate_python(data)
    except ValidationError:
        raise
    except Exception:  # noqa: BLE001 - the twin lacks some of the model's logic (a wrap validator): the model decides
        pass

"""`surge serve`'s options, derived from the config fields (config.py): a default is written once.

Every field of ServerConfig and of its sections (engine, batching, cache, limits, metrics, responses) is a
flag and a `SURGE_*` variable: the flag is the field's name in kebab case (a section's
`flag_prefix` in front; a field's `json_schema_extra={"flag": ...}` renames it, or with
None leaves it out: it is then set another way, said in `OMITTED`), the variable is `SURGE_`
plus the flag in capitals, the help is the field's description, the default is the field's.
Fields of two sections under one flag (`--max-batch-size`: the engine's and the batcher's)
are set together. Adding a field adds its flag and its variable.

Only what a flag or a variable sets reaches the ServerConfig (the rest keeps the field's
default and stays out of `model_fields_set`), so the model loader can tell what the user
set: flag > SURGE_* variable > model.yaml > field default (cli/bootstrap.py merges them).
"""

from __future__ import annotations

import inspect
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Literal, Optional

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from surge.config import (BatchingConfig, CacheConfig, EngineConfig, LimitsConfig, MetricsConfig, ResponsesConfig,
                          ServerConfig)

# The sections a flag can set: (attribute of ServerConfig or "" for its own fields, class).
SECTIONS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("", ServerConfig), ("engine", EngineConfig), ("batching", BatchingConfig), ("cache", CacheConfig),
    ("limits", LimitsConfig), ("metrics", MetricsConfig), ("responses", ResponsesConfig))

# Fields that are no flag of their own, and why (the test of every field reads this).
OMITTED = {
    "engine": "a section (its fields are flags)", "batching": "a section", "cache": "a section",
    "limits": "a section", "metrics": "a section", "responses": "a section",
    "generation": "a section: --generation FIELD=VALUE and SURGE_GENERATION_<FIELD> (GenerationConfig.from_sources)",
    "model_dir": "the MODEL_DIR argument (SURGE_MODEL_DIR)",
}


@dataclass
class Flag:
    param: str  # the callback's parameter name
    decl: str  # "--max-batch-size", or "--batching/--no-batching"
    envvar: str
    targets: list[tuple[str, str]]  # (section, field) pairs it sets
    info: FieldInfo
    kind: Any  # the Python type the option takes
    multiple: bool = False
    choices: tuple | None = None

    @property
    def name(self) -> str:
        return self.decl.split("/")[0]


def _flag_name(section: str, cls: type[BaseModel], field: str, info: FieldInfo) -> str | None:
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "flag" in extra:
        return extra["flag"]
    if section == "" and field in OMITTED:
        return None
    return getattr(cls, "flag_prefix", "") + field.replace("_", "-")


def _unwrap(annotation):
    """(python type of the option, whether it repeats, Literal choices) for a field's annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0])
    if origin is Literal:
        values = typing.get_args(annotation)
        return str, False, tuple(str(v) for v in values)
    if origin in (list, tuple):
        return str, True, None  # items: "a,b" and/or repeated; tuples "1x16"
    return annotation, False, None


def flags() -> list[Flag]:
    """Every derived flag, in the order of the config classes."""
    out: dict[str, Flag] = {}
    for section, cls in SECTIONS:
        for field, info in cls.model_fields.items():
            name = _flag_name(section, cls, field, info)
            if name is None:
                continue
            if name in out:  # one flag for fields of two sections: their defaults must agree
                flag = out[name]
                first = flag.targets[0]
                other = dict(SECTIONS)[first[0]].model_fields[first[1]]
                if other.get_default(call_default_factory=True) != info.get_default(call_default_factory=True):
                    raise TypeError(f"--{name}: {first} and {section}.{field} have different defaults")
                flag.targets.append((section, field))
                continue
            kind, multiple, choices = _unwrap(info.annotation)
            param = name.replace("-", "_")
            decl = f"--{name}"
            if kind is bool and info.default is True:
                decl = f"--{name}/--no-{name}"
            out[name] = Flag(param, decl, "SURGE_" + param.upper(), [(section, field)], info, kind, multiple,
                             choices)
    return list(out.values())


def _option(flag: Flag) -> inspect.Parameter:
    info = flag.info
    default = info.get_default(call_default_factory=True)
    if flag.multiple:
        default = None  # the field's default applies when the flag is not given
    elif isinstance(default, Path):
        default = str(default)
    help_text = info.description or ""
    option = typer.Option(default, flag.decl, envvar=flag.envvar, help=help_text)
    kind = Literal[flag.choices] if flag.choices else flag.kind  # typer lists a Literal's values
    kind = List[str] if flag.multiple else (kind if default is not None else Optional[kind])
    return inspect.Parameter(flag.param, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)


def with_config_options(extra: list[inspect.Parameter]):
    """Decorator: the command takes `config` (a ServerConfig of what was set) and the `extra`
    parameters (options that are no config field: --artifact, --ray...); the config fields'
    options are added to its signature."""
    derived = flags()

    def wrap(func):
        ctx_param = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        params = [ctx_param] + extra + [_option(f) for f in derived]

        def command(ctx: typer.Context, **kwargs):
            values = {f.param: kwargs.pop(f.param) for f in derived}
            # Set on the command line or by a variable (not a default): what reaches the config.
            given = {f.param for f in derived
                     if getattr(ctx.get_parameter_source(f.param), "name", "DEFAULT") in ("COMMANDLINE", "ENVIRONMENT")}
            return func(config_values=(values, given), **kwargs)

        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.__name__ = func.__name__
        command.__doc__ = func.__doc__
        return command

    return wrap


def build_config(values: dict, given: set[str], **more) -> ServerConfig:
    """A ServerConfig holding what the flags and variables set (`given`), plus `more` fields
    (already parsed: the model directory, the generation settings). A ValueError names the flag."""
    from pydantic import ValidationError

    sections: dict[str, dict] = {s: {} for s, _ in SECTIONS}
    for flag in flags():
        if flag.param not in given:
            continue
        value = values[flag.param]
        if flag.multiple:
            value = _items(value, flag)
        for section, field in flag.targets:
            sections[section][field] = value
    cache = sections["cache"]
    if ({"max_bytes", "pinned_top_k"} & set(cache)) and "enabled" not in cache:
        fields = CacheConfig.model_fields  # a cache with room for nothing is off
        if cache.get("max_bytes", fields["max_bytes"].default) == 0 and \
                cache.get("pinned_top_k", fields["pinned_top_k"].default) == 0:
            cache["enabled"] = False
    own = sections.pop("")
    own.update(more)
    data = {**own, **{s: v for s, v in sections.items() if v}}
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(str(p) for p in err.get("loc", ()))
        flag = next((f.name for f in flags() for s, fld in f.targets
                     if (s, fld) == (loc[0], loc[1] if len(loc) > 1 else "") or (not s and (fld,) == loc[:1])),
                    None)
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        raise typer.BadParameter(msg, param_hint=flag) from None


def _items(raw: list[str] | None, flag: Flag) -> list:
    """Comma-separated and/or repeated values; a tuple item is written `1x16`."""
    items = [p.strip() for v in raw or [] for p in str(v).split(",") if p.strip()]
    args = typing.get_args(_strip_none(flag.info.annotation))
    if args and typing.get_origin(args[0]) is tuple:
        return [tuple(p.split("x")) for p in items]
    return items


def _strip_none(annotation):
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_fallbacks(values: dict, given: set[str]) -> None:
    """The variable of a switch's `--no-` form: SURGE_NO_CACHE=1 is --no-cache, as the README's rule (SURGE_ and
    the flag's name) reads it, where click reads only SURGE_CACHE=false; SURGE_NO_BATCHING of earlier releases
    is one. The flag itself and SURGE_X (`given`) beat it."""
    for flag in flags():
        if "/--no-" not in flag.decl or flag.param in given:
            continue
        var = "SURGE_NO_" + flag.param.upper()
        raw = os.environ.get(var)
        if raw is None or not raw.strip():
            continue
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise typer.BadParameter(f"{var}={raw[:64]!r}: expected 1 or 0 (true / false)",
                                     param_hint=flag.decl.split("/")[1])
        values[flag.param] = word in _FALSE
        given.add(flag.param)

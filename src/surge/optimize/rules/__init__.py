"""surge's library of subgraph rewrite rules (onnxscript pattern rules).

Each rule keeps the outputs equal (tests in tests/unit/optimize/test_rules.py
check every one on random inputs). `default_rules()` is what the rewrite pass
applies next to onnxscript's own default rules; users add theirs by import
path (`--rule package.module:obj`), see `load_user_rules`.
"""

from __future__ import annotations

import importlib

from onnxscript.rewriter import RewriteRule, RewriteRuleClassBase, RewriteRuleSet

from surge.errors import ConfigError


def default_rules() -> list[RewriteRule]:
    from surge.optimize.rules import arith, split_concat

    return [*split_concat.rules(), *arith.rules()]


def load_user_rules(path: str) -> list[RewriteRule]:
    """`pkg.mod:name` (or `pkg.mod.name`): a RewriteRule, RewriteRuleSet, rule class, list, or a function returning one."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"rewrite rule {path!r}: expected 'package.module:name'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"rewrite rule {path!r}: cannot import ({exc})") from exc
    return _as_rules(obj, path)


def _as_rules(obj, path: str) -> list[RewriteRule]:
    if isinstance(obj, RewriteRule):
        return [obj]
    if isinstance(obj, RewriteRuleSet):
        return list(obj.rules)
    if isinstance(obj, type) and issubclass(obj, RewriteRuleClassBase):
        return [obj.rule()]
    if isinstance(obj, (list, tuple)):
        return [r for item in obj for r in _as_rules(item, path)]
    if callable(obj):
        return _as_rules(obj(), path)
    raise ConfigError(f"rewrite rule {path!r}: {type(obj).__name__} is not a rewrite rule")

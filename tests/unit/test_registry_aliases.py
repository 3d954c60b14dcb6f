"""ModelRegistry aliases and change notifications (no engine needed: the registry
only reads a served object's name, version and ready)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from surge.errors import ConfigError, NotFound
from surge.runtime.registry import ModelRegistry


@dataclass
class Served:
    name: str
    version: str = "1"
    ready: bool = True


def test_alias_resolves_for_every_lookup_and_survives_unload():
    reg = ModelRegistry()
    changes = []
    reg.subscribe(lambda: changes.append(sorted(reg.names())))
    a, a2 = Served("mini"), Served("mini", "2")
    reg.add(a)
    reg.add(a2)
    reg.set_aliases("mini", ["text-embedding-3-small", "mini", "ada", "ada"])  # itself and repeats dropped
    assert reg.aliases() == {"text-embedding-3-small": "mini", "ada": "mini"}
    assert reg.get("ada") is a2 and reg.get("ada", "1") is a and reg.versions("ada") == ["1", "2"]
    reg.remove("mini", "1")
    reg.remove("mini", "2")
    with pytest.raises(NotFound, match="'ada' \\(an alias of 'mini'\\) is not loaded"):
        reg.get("ada")
    reg.add(a)
    assert reg.get("text-embedding-3-small") is a
    reg.set_aliases("mini", ["ada"])  # replaces the set
    assert reg.aliases() == {"ada": "mini"}
    assert len(changes) == 7  # add, add, set, remove, remove, add, set


def test_alias_clashes_are_config_errors_and_a_model_name_wins():
    reg = ModelRegistry()
    reg.add(Served("a"))
    reg.add(Served("b"))
    with pytest.raises(ConfigError, match="name of another model"):
        reg.set_aliases("a", ["b"])
    reg.set_aliases("a", ["x"])
    with pytest.raises(ConfigError, match="already names model 'a'"):
        reg.set_aliases("b", ["x"])
    with pytest.raises(ConfigError, match="empty or has surrounding spaces"):
        reg.set_aliases("b", [" y"])
    with pytest.raises(NotFound, match="available: a, b, x"):
        reg.get("nope")
    reg.add(Served("x"))  # a model named like an alias: the model wins
    assert reg.get("x").name == "x" and "x" not in reg.aliases()


def test_while_the_server_loads_a_missing_model_is_503_not_404():
    """A --workers front end accepts connections while it still loads its models: a request then must get
    a retryable 503, not a 404 that says the model does not exist."""
    from surge.errors import NotReady

    reg = ModelRegistry()
    reg.loading = True
    for name in (None, "mini"):
        with pytest.raises(NotReady, match="not loaded yet") as err:
            reg.get(name)
        assert err.value.http_status == 503 and err.value.retry_after == 1
    reg.loading = False
    with pytest.raises(NotFound, match="no model is loaded"):
        reg.get()
    reg.add(Served("mini"))
    with pytest.raises(NotFound, match="'other' not found"):
        reg.get("other")


def test_not_found_lists_only_names_that_answer():
    """An unknown name's 404 says what is available: after `mini` is unloaded its aliases answer 404 too,
    so they are not listed (they were: "available: ada" with nothing loaded)."""
    reg = ModelRegistry()
    reg.add(Served("mini"))
    reg.add(Served("other"))
    reg.set_aliases("mini", ["ada"])
    reg.set_aliases("other", ["small"])
    with pytest.raises(NotFound, match="available: mini, other, ada, small$"):
        reg.get("nope")
    reg.remove("mini", "1")
    with pytest.raises(NotFound, match="available: other, small$"):
        reg.get("nope")
    reg.remove("other", "1")
    with pytest.raises(NotFound, match="available: none$"):
        reg.get("nope")

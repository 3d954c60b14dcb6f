"""The outlier split's setting: one default wherever it can be given, and a clear error for a bad value."""

from __future__ import annotations

import inspect

import pytest

from surge.errors import ConfigError
from surge.optimize.int8_search import OUTLIER_CHANNELS, build_int8
from surge.optimize.pipeline import OptimizeOptions


def test_outlier_channels_default_is_the_same_in_every_entry_point():
    from surge.cli.optimize import optimize as cli_optimize

    cli_default = inspect.signature(cli_optimize).parameters["int8_outliers"].default.default
    assert OUTLIER_CHANNELS > 0
    assert (OptimizeOptions().int8_outliers == cli_default == OUTLIER_CHANNELS
            == inspect.signature(build_int8).parameters["outlier_channels"].default)


@pytest.mark.parametrize("value,ok", [(-1, False), (0, True), (OUTLIER_CHANNELS, True)])
def test_negative_outlier_channels_is_a_config_error(value, ok):
    options = OptimizeOptions(precision="int8", int8_outliers=value)
    if ok:
        options.check()
    else:
        with pytest.raises(ConfigError, match="int8-outliers"):
            options.check()


def test_search_tries_the_outlier_split_and_keeps_it_only_if_better(fused_minilm, bundled_spec, bundled_export):
    """build_int8's step 3 on the bundled model: recorded with its before/after calibration numbers, and the
    plan it returns is the split one exactly when the split measured better (and then has one Gather a node)."""
    from surge.data import calibration_queries, heldout_queries
    from surge.optimize.validate import Budget, Evaluator

    ev = Evaluator(bundled_spec, bundled_export, calibration_queries()[:96], heldout_queries()[:8], threads=2)
    budget = Budget(mean_cosine=0.99, min_cosine=0.99, top1_strict=0.999)  # out of reach: every step runs
    plan = build_int8(fused_minilm, ev, budget, alpha=0.65, search=False)
    split = plan.info["outlier_split"]
    assert split["channels"] == OUTLIER_CHANNELS and set(split) == {"channels", "before", "after", "chosen"}
    better = (split["after"]["mean_cosine"], split["after"]["tail_cosine"]) > \
        (split["before"]["mean_cosine"], split["before"]["tail_cosine"])
    assert split["chosen"] is better
    gathers = sum(n.op_type == "Gather" and n.name.startswith("rowq/") for n in plan.model.graph.node)
    assert gathers == (24 if better else 0)
    assert (plan.info.get("outlier_channels") or {}).get("nodes", 0) == gathers
    # and it is off when asked
    off = build_int8(fused_minilm, ev, budget, alpha=0.65, search=False, outlier_channels=0)
    assert "outlier_split" not in off.info

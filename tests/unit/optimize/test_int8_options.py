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

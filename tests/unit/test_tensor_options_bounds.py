"""The `tensor:` section's numbers are bounded where the values would load and then fail every
request: a python timeout past what Connection.poll takes (~2,147,483 s; OverflowError on each call)
and a max_batch_size past Triton's int32 ModelConfig field (GET /v2/models/x/config fails)."""

from __future__ import annotations

import pytest

from surge.runtime.repository import scan_model

DECL = """kind: python
tensor:
  %s
  inputs: [{name: x, datatype: FP32, dims: [4]}]
  outputs: [{name: y, datatype: FP32, dims: [4]}]
"""


@pytest.mark.parametrize("setting, field", [
    ("timeout_s: .inf", "tensor.timeout_s"),
    ("timeout_s: 3000000", "tensor.timeout_s"),
    ("init_timeout_s: .inf", "tensor.init_timeout_s"),
    ("init_timeout_s: 1e300", "tensor.init_timeout_s"),
    ("max_batch_size: 100000000000000000000", "tensor.max_batch_size"),
    ("max_batch_size: 2147483648", "tensor.max_batch_size"),
])
def test_out_of_range_values_are_config_errors(tmp_path, setting, field):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.yaml").write_text(DECL % setting)
    error = scan_model(tmp_path, "m").versions["1"].error
    assert error is not None and field in error, error


@pytest.mark.parametrize("setting", ["timeout_s: 86400", "init_timeout_s: 3600", "max_batch_size: 2147483647"])
def test_large_values_in_range_are_taken(tmp_path, setting):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.yaml").write_text(DECL % setting)
    ventry = scan_model(tmp_path, "m").versions["1"]
    assert ventry.error is None, ventry.error

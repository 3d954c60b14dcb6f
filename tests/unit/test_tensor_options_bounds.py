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


# batching.max_batch_size reaches a python model's contract (and Triton's int32 ModelConfig field) when
# tensor.max_batch_size is not given: it is bounded the same way, for every kind.
@pytest.mark.parametrize("value", ["100000000000000000000", "2147483648"])
def test_batching_max_batch_size_past_int32_is_a_config_error(tmp_path, value):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.yaml").write_text(f"batching: {{max_batch_size: {value}}}\n" + DECL % "")
    error = scan_model(tmp_path, "m").versions["1"].error
    assert error is not None and "batching.max_batch_size" in error, error


def test_batching_max_batch_size_at_int32_max_is_taken(tmp_path):
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.yaml").write_text("batching: {max_batch_size: 2147483647}\n" + DECL % "")
    assert scan_model(tmp_path, "m").versions["1"].error is None


PBTXT = """backend: "python"
max_batch_size: %s
dynamic_batching {}
input [{name: "x", data_type: TYPE_FP32, dims: [4]}]
output [{name: "y", data_type: TYPE_FP32, dims: [4]}]
"""


@pytest.mark.parametrize("value", ["100000000000000000000", "2147483648", "-1"])
def test_config_pbtxt_max_batch_size_out_of_range_names_its_own_field(tmp_path, value):
    """The message names the field as config.pbtxt spells it (not model.yaml's tensor.max_batch_size)."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.py").write_text("")
    (tmp_path / "m" / "config.pbtxt").write_text(PBTXT % value)
    error = scan_model(tmp_path, "m").versions["1"].error
    assert error is not None and "config.pbtxt: field 'max_batch_size'" in error and "2147483647" in error, error

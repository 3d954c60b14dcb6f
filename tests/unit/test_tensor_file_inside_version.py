"""A tensor model's `tensor.file` names a file in its version directory (its documented contract): an absolute
path or one climbing out with '..' loaded whatever file it named (another model's graph, /etc/hostname echoed in
the error), which a repository's model.yaml must not reach."""

from __future__ import annotations

import pytest

from surge.errors import ConfigError
from surge.models.tensor_config import TensorModelOptions
from surge.runtime.tensor_loader import model_path


@pytest.mark.parametrize("name", ["/etc/hostname", "../other.onnx", "sub/../../other.onnx", "../1/model.onnx"])
def test_a_file_outside_the_version_directory_is_refused(tmp_path, name):
    version = tmp_path / "m" / "1"
    version.mkdir(parents=True)
    (version / "model.onnx").write_bytes(b"x")
    (tmp_path / "m" / "other.onnx").write_bytes(b"x")
    with pytest.raises(ConfigError) as err:
        model_path(version, "onnx", TensorModelOptions(file=name))
    assert err.value.param == "tensor.file" and "/etc" not in err.value.message


def test_a_file_in_a_subdirectory_of_the_version_is_taken(tmp_path):
    version = tmp_path / "m" / "1"
    (version / "graphs").mkdir(parents=True)
    (version / "graphs" / "g.onnx").write_bytes(b"x")
    assert model_path(version, "onnx", TensorModelOptions(file="graphs/g.onnx")) == version / "graphs" / "g.onnx"
    assert model_path(version, "onnx", TensorModelOptions(file="graphs/./g.onnx")).is_file()

"""Version names are ASCII digits: "²" passes str.isdigit() but int("²") raises, which broke the
scan of the whole model (GET /models, the index, the start) and made a load request a 500."""

from __future__ import annotations

import pytest

from surge.errors import InvalidInput
from surge.runtime.repository import _check_version, scan_model


def test_a_directory_named_with_other_unicode_digits_is_not_a_version(tmp_path):
    for sub in ("1", "²"):
        (tmp_path / "m" / sub).mkdir(parents=True)
        (tmp_path / "m" / sub / "model.yaml").write_text("kind: onnx\n")
    assert sorted(scan_model(tmp_path, "m").versions) == ["1"]


@pytest.mark.parametrize("version", ["²", "1²", "", "-1", "x"])
def test_a_requested_version_that_is_not_ascii_digits_is_invalid_input(version):
    with pytest.raises(InvalidInput, match="version must be a positive integer"):
        _check_version(version)

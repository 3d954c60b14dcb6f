"""An encoder's KServe metadata and its Triton config name one platform: the device's kind. On a GPU the
metadata said surge_cuda:0 and the config surge_cuda, so a client matching the two saw two models."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from surge.config import BatchingConfig
from surge.server import kserve_contract, kserve_tensor


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "cuda:1"])
def test_metadata_and_config_name_the_same_platform(device):
    caps = SimpleNamespace(device=device, max_batch=64)
    service = SimpleNamespace(name="m", task="embed", kind="hf", dimensions=384, batching=BatchingConfig(),
                              worker=SimpleNamespace(engines=SimpleNamespace(capabilities=caps, engines=[object()])))
    meta = kserve_contract.model_metadata(service, ["1"])
    cfg = kserve_tensor.model_config(service)
    assert meta["platform"] == cfg["platform"] == "surge_" + device.split(":")[0]

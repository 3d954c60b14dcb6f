"""GPU metrics: a no-op without a GPU; real gauges from NVML with one."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from surge.engines.gpu_metrics import register_gpu_metrics


def test_register_is_safe_everywhere():
    reg = CollectorRegistry()
    collector = register_gpu_metrics(reg)
    text = generate_latest(reg).decode()
    if collector is None:
        assert "surge_gpu" not in text
    else:
        assert "surge_gpu_utilization_ratio" in text


@pytest.mark.cuda
def test_gauges_under_load():
    import torch

    reg = CollectorRegistry()
    collector = register_gpu_metrics(reg)
    assert collector is not None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    for _ in range(200):
        a = a @ a
        a = a / a.norm()
    text = generate_latest(reg).decode()
    torch.cuda.synchronize()
    print(text)
    assert 'surge_gpu_memory_used_bytes{gpu="0"}' in text
    util = reg.get_sample_value("surge_gpu_utilization_ratio", {"gpu": "0"})
    assert util is not None and 0.0 <= util <= 1.0
    if collector.gpm[0]:
        occ = reg.get_sample_value("surge_gpu_sm_occupancy_ratio", {"gpu": "0"})
        assert occ is not None and 0.0 <= occ <= 1.0

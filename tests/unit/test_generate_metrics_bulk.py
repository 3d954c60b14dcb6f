"""GenerateMetrics.observe_itl: gaps observed in bulk give the histogram exactly what one observe() each gives."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry

from surge.runtime.generate_metrics import _ITL, GenerateMetrics


def _itl_samples(registry: CollectorRegistry) -> dict:
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if "itl" in s.name or "inter_token" in s.name:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_bulk_itl_equals_one_observe_per_value():
    rng = np.random.default_rng()
    # log-uniform gaps from 0.1 ms to 3 s, plus every bucket bound exactly (observe() counts v <= bound)
    values = list(np.exp(rng.uniform(np.log(1e-4), np.log(3.0), 5000))) + list(_ITL) + [0.0]
    rng.shuffle(values)
    bulk_reg, one_reg = CollectorRegistry(), CollectorRegistry()
    bulk, one = GenerateMetrics("m", "1", bulk_reg), GenerateMetrics("m", "1", one_reg)
    for chunk in np.array_split(np.array(values), 37):  # as engine steps deliver them
        bulk.observe_itl([float(v) for v in chunk])
    for v in values:
        one.itl.observe(float(v))
    got, want = _itl_samples(bulk_reg), _itl_samples(one_reg)
    assert want and set(got) == set(want)
    for key, v in want.items():
        assert np.isclose(got[key], v, rtol=1e-9, atol=1e-9), key
    assert any(k[0].endswith("_count") and v == len(values) for k, v in got.items())

"""engines/device_pool.py (pooling inside the CUDA graph) computes what the host pooling does,
on packed batches padded to a bucket (empty trailing sequences, junk past the real tokens): the row
gathers, which run on any device. The mean is a Triton kernel (kernels/segment_mean.py), checked against
float64 and at every offset on the GPU (tests/gpu/test_batch_invariance_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.engines.device_pool import pool_on_device
from surge.engines.pooling import _pool_packed


@pytest.mark.parametrize("mode", ["cls", "last"])
def test_device_pooling_matches_host_pooling(mode):
    rng = np.random.default_rng()
    for _ in range(20):
        b = int(rng.integers(1, 9))
        lengths = rng.integers(1, 40, b)
        t = int(lengths.sum())
        bb, tb = b + int(rng.integers(0, 4)), t + int(rng.integers(0, 30))
        hidden = rng.standard_normal((tb, 16)).astype(np.float32)  # rows past t: junk a bucket holds
        cu = np.zeros(bb + 1, np.int64)
        cu[1:b + 1] = np.cumsum(lengths)
        cu[b + 1:] = t
        inputs = torch.from_numpy(np.concatenate([np.zeros(3 * tb, np.int64), cu]).astype(np.int32))
        got = pool_on_device(torch.from_numpy(hidden).to(torch.float16), inputs, (bb, tb, 32), mode).numpy()
        want = _pool_packed(hidden.astype(np.float16).astype(np.float32)[:t], cu[:b + 1], mode)
        assert got.shape == (bb, 16)
        np.testing.assert_allclose(got[:b], want, rtol=1e-5, atol=1e-5)

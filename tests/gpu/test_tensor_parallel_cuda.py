"""Tensor parallelism on CUDA (fused path, CUDA graphs, NCCL all-reduces inside them).

World 1 runs on any GPU; world 2 needs two (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.engines.tensor_parallel import TensorParallelEngine
from surge.engines.encoder import forward_reference, position_ids
from surge.engines.tp_weights import random_shard, small_config
from surge.types import Encoded, TokenBatch
from tests.conftest import cosine_rows

pytestmark = pytest.mark.cuda

CFG = small_config(hidden=256, heads=8, layers=3, intermediate=1024, vocab=3000, max_positions=200)


def _batch(rng, n):
    return TokenBatch.pack([Encoded(rng.integers(0, CFG.vocab, int(k)), np.zeros(int(k), dtype=np.int64))
                            for k in rng.integers(1, 150, size=n)])


def _unsplit_fp32(batch: TokenBatch) -> np.ndarray:
    """The whole model (random weights are drawn on the GPU: same device type as the engines') in FP32,
    through encoder.forward_reference."""
    w = random_shard(CFG, 11, 0, 1, device="cuda:0", dtype=torch.float32)
    t = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).cuda()  # noqa: E731
    cu = [0] + np.cumsum(batch.lengths).tolist()
    with torch.inference_mode():
        x = forward_reference(w, t(batch.input_ids), t(batch.token_type_ids), t(position_ids(batch.lengths, 0)), cu)
    return x.cpu().numpy()


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_split_equals_unsplit_fp32(world, precision):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    e = TensorParallelEngine(world=world, devices=list(range(world)), precision=precision, seed=11, max_batch=32)
    e.load(CFG)
    try:
        rng = np.random.default_rng()
        for n in (1, 7, 32, 7):  # 7 twice: the second replays the captured graph
            b = _batch(rng, n)
            cos = cosine_rows(e.run(b), _unsplit_fp32(b))
            assert cos.min() >= 0.999, f"worst cosine {cos.min():.6f}"
        p = e.profile(_batch(rng, 1), iters=5)
        assert p["total_ms"] > 0 and p["compute_ms"] > 0 and (world == 1 or p["allreduce_ms"] > 0)
    finally:
        e.close()


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_cuda_split_is_batch_invariant(world, precision):
    """batch_invariant (the default): each shard on the one-tiling Triton GEMMs and fixed attention tile, the
    partials summed in rank order (world 4: gathered inside the CUDA graph, Groups.sum_in_rank_order), so a
    sequence's hidden states are bit for bit the same alone and among random neighbours of any count and
    length; and still within the split test's cosine of the unsplit model in FP32."""
    from tests.batch_moves import moved

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    e = TensorParallelEngine(world=world, devices=list(range(world)), precision=precision, seed=11, max_batch=64)
    e.load(CFG)
    try:
        assert e.opts.batch_invariant and e.runner.gemm == "invariant"
        rng = np.random.default_rng()
        items = [Encoded(rng.integers(0, CFG.vocab, int(k)), np.zeros(int(k), dtype=np.int64))
                 for k in np.concatenate([[1, 2, 16, 17, 64, 65, 150], rng.integers(1, 151, size=63)])]
        run = lambda its: e.run(TokenBatch.pack(its))  # noqa: E731
        out = moved(run, items, rng, 6)
        assert not out, f"world {world} {precision}: {len(out)} of {len(items)} sequences moved with their batch"
        b = TokenBatch.pack(items[:40])
        cos = cosine_rows(run(items[:40]), _unsplit_fp32(b))
        assert cos.min() >= 0.999, f"worst cosine {cos.min():.6f}"
    finally:
        e.close()

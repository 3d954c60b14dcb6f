"""Workspace reuse, sharing and weight offload give the plain engine's numbers; the plan predicts the peak."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from surge.engines.base import random_batch
from surge.types import Layout

pytestmark = pytest.mark.cuda


def _bert(tmp_path, **kw):
    from transformers import BertConfig, BertModel

    cfg = BertConfig(**kw)
    BertModel(cfg, add_pooling_layer=False).save_pretrained(tmp_path)
    return tmp_path


def _batches(vocab, n=3):
    rng = np.random.default_rng()
    out = []
    for _ in range(n):
        from surge.types import Encoded, TokenBatch

        lengths = rng.integers(1, 130, size=int(rng.integers(1, 17)))
        out.append(TokenBatch.pack([Encoded(rng.integers(1000, vocab, size=int(n)), np.zeros(int(n), np.int64))
                                    for n in lengths]))
    return out


def test_weight_offload_matches_resident(model_dir):  # noqa: F811
    from surge.engines.torch_gpu import TorchEngine

    plain = TorchEngine(device="cuda", precision="fp16", max_batch=16, gemm="cublas", cuda_graphs=False)
    plain.load(model_dir)
    w = plain.weights
    embed = sum(t.numel() * t.element_size() for t in w.embedding_tensors())
    layer = w.layers[0].nbytes()
    off = TorchEngine(device="cuda", precision="fp16", max_batch=16, gemm="cublas",
                      weight_budget=embed + 3 * layer + layer // 2)
    off.load(model_dir)
    assert len(off.offload.resident) == 1 and len(off.offload.host) == 5
    for b in _batches(30522):
        np.testing.assert_array_equal(off.run(b), plain.run(b))


def test_three_models_share_one_workspace(model_dir, tmp_path):  # noqa: F811
    from surge.engines.memory import Workspace
    from surge.engines.torch_gpu import TorchEngine

    big = _bert(tmp_path, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024)
    specs = [(model_dir, "fp16"), (model_dir, "bf16"), (big, "fp16")]
    shared = Workspace("cuda")
    together = [TorchEngine(device="cuda", precision=p, max_batch=16, workspace=shared, gemm="cublas") for _, p in specs]
    alone = [TorchEngine(device="cuda", precision=p, max_batch=16, gemm="cublas") for _, p in specs]
    for e, (path, _) in zip(together + alone, specs + specs):
        e.load(path)
    assert shared.nbytes == max(e.plan.nbytes for e in together)
    for _ in range(2):  # interleaved runs: each model's graphs must see only its own data
        for t, a in zip(together, alone):
            for b in _batches(30522, 2):
                np.testing.assert_array_equal(t.run(b), a.run(b))


def test_plan_predicts_measured_peak(tmp_path):
    from surge.engines.memory import memory_report
    from surge.engines.torch_gpu import TorchEngine

    path = _bert(tmp_path)  # bert-base shape
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    e = TorchEngine(device="cuda", precision="fp16", max_batch=64, max_tokens=64 * 512)
    e.load(path)
    batches = [random_batch(64, 512, 30522, Layout.PACKED), random_batch(7, 33, 30522, Layout.PACKED)]
    for b in batches:  # first runs capture graphs and tune kernels (one-off scratch memory)
        e.run(b)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for b in batches:
        e.run(b)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    rep = memory_report(e.config, 64, 512, torch.float16)
    predicted = rep["weights"] + rep["workspace"] + rep["libraries"]
    print(f"predicted {predicted / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    assert abs(measured - predicted) <= 0.10 * predicted

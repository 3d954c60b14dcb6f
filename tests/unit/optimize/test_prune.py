"""Head pruning: the sliced model computes exactly what the model with those heads silenced computes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from surge.optimize.prune import _embed, head_importance, prune_heads
from tests.conftest import CACHE_DIR


def test_pruned_model_equals_silenced_heads(tiny_spec, sentences):
    import torch

    from surge.optimize.export import load_torch_model
    from surge.optimize.validate import Encoded

    model = load_torch_model(tiny_spec)
    scores = head_importance(model, tiny_spec, sentences[:16])
    assert scores.shape == (tiny_spec.num_layers, tiny_spec.num_heads) and (scores > 0).all()
    size = tiny_spec.hidden_size // tiny_spec.num_heads
    drop = {0: [1, 3], 1: [0]}
    keep = {li: [h for h in range(tiny_spec.num_heads) if h not in d] for li, d in drop.items()}
    data = Encoded(tiny_spec, sentences[20:30])
    batches = [tuple(torch.from_numpy(a) for a in (b.input_ids, b.attention_mask, b.token_type_ids)) for b in data.batches]
    handles = []
    for li, layer in enumerate(model.encoder.layer):
        def silence(module, args, heads=drop[li]):
            x = args[0].clone()
            for h in heads:
                x[..., h * size : (h + 1) * size] = 0
            return (x,)
        handles.append(layer.attention.output.dense.register_forward_pre_hook(silence))
    silenced = _embed(model, batches, tiny_spec)
    for h in handles:
        h.remove()
    prune_heads(model, keep, size)
    assert model.encoder.layer[0].attention.self.query.out_features == 2 * size
    pruned = _embed(model, batches, tiny_spec)
    np.testing.assert_allclose(pruned.numpy(), silenced.numpy(), atol=1e-5)


def test_pipeline_prunes_and_gate_decides(tmp_path, tiny_spec, sentences):
    from surge.optimize.pipeline import OptimizeOptions, optimize

    opts = OptimizeOptions(prune_heads=0.5, calibration=sentences[:24], heldout=sentences[200:224],
                           measure_latency=False, threads=2)
    result = optimize(tiny_spec, tmp_path / "pruned", opts, CACHE_DIR)
    m = json.loads((tmp_path / "pruned" / "manifest.json").read_text())
    assert result.written and m["pruning"]["heads_per_layer"] == tiny_spec.num_heads // 2
    assert m["pruning"]["heads_removed"] == tiny_spec.num_layers * tiny_spec.num_heads // 2
    assert m["validation"]["budget"]["mean_cosine"] == 0.99  # pruning is judged on the lossy budget
    assert m["op_types"]["after"].get("com.microsoft::Attention") == tiny_spec.num_layers  # pruned layers still fuse
    # The written graph really is smaller: the QKV weights lost half their columns.
    import onnx

    weights = [t for t in onnx.load(str(tmp_path / "pruned" / "model.onnx")).graph.initializer if len(t.dims) == 2]
    assert any(t.dims[1] == 3 * tiny_spec.hidden_size // 2 or t.dims[1] == tiny_spec.hidden_size // 2 for t in weights)

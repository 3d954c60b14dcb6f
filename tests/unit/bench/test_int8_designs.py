"""benchmarks/int8_designs.py: serving-shaped batches and interleaved engine timing."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import int8_designs as D  # noqa: E402


def test_serving_batches_are_length_sorted_padded_batches_of_real_texts(bundled_spec):
    from surge.data import heldout_queries

    texts = heldout_queries()[:300]
    batches = D.serving_batches(bundled_spec, texts, batch=8, count=5, seed=int(np.random.default_rng().integers(1000)))
    assert len(batches) == 5 and all(b["input_ids"].shape[0] == 8 for b in batches)
    lengths = [b["attention_mask"].sum(1) for b in batches]
    flat = np.concatenate(lengths)
    assert (np.diff(flat) >= 0).all()  # sorted across the batches, as the batcher groups by length
    for b, n in zip(batches, lengths):
        assert b["input_ids"].shape[1] == n.max()  # padded to the batch's longest, no further
        assert (b["input_ids"][b["attention_mask"] == 0] == bundled_spec.pad_token_id).all()


def test_engine_times_every_model_on_the_same_batches():
    rng = np.random.default_rng()

    def model(width):
        w = numpy_helper.from_array(rng.standard_normal((6, width)).astype(np.float32), "w")
        graph = helper.make_graph(
            [helper.make_node("Cast", ["input_ids"], ["x"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "w"], ["out"])],
            "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", 6])],
            [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["b", width])], [w])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m.SerializeToString()

    ids = rng.integers(0, 50, (4, 6)).astype(np.int64)
    batches = [{"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}] * 3
    times = D.engine_times({"small": model(4), "large": model(2048)}, batches, threads=1, rounds=3)
    assert set(times) == {"small", "large"} and all(t > 0 for t in times.values())

"""The KServe v2 tensor contract (server/kserve_contract.py) and the statistics
it reports (runtime/stats.py), on random inputs."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from surge.errors import InvalidInput, PayloadTooLarge
from surge.runtime.stats import InferenceStats
from surge.server import kserve_contract as c
from surge.types import EmbedResult

rng = np.random.default_rng(20261129)


def _raw_bytes(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def _random_texts(n: int) -> list[str]:
    alphabet = list("abcdefghij klmnopqrstuvwxyzäöü€漢字🙂")
    return ["".join(rng.choice(alphabet, size=int(rng.integers(1, 40)))) for _ in range(n)]


def test_bytes_raw_round_trip():
    items = [t.encode() for t in _random_texts(7)] + [b""]
    t = c.from_raw("text", "BYTES", [8], _raw_bytes(items))
    assert t.values == items and t.shape == (8,)


@pytest.mark.parametrize("cut,needle", [(2, "4-byte length"), (5, "remain")])
def test_bytes_raw_truncated(cut, needle):
    raw = _raw_bytes([b"hello", b"world!"])
    # cut inside the second element's data, or inside its length prefix
    raw = raw[: 4 + 5 + cut] if cut == 2 else raw[:-cut]
    with pytest.raises(InvalidInput, match=needle):
        c.from_raw("text", "BYTES", [2], raw)


def test_bytes_raw_count_mismatch():
    with pytest.raises(InvalidInput, match="needs 3"):
        c.from_raw("text", "BYTES", [3], _raw_bytes([b"a", b"b"]))


def test_numeric_raw_values_and_size():
    ids = rng.integers(0, 30000, size=(3, 5), dtype=np.int64)
    t = c.from_raw("input_ids", "INT64", [3, 5], ids.astype("<i8").tobytes())
    np.testing.assert_array_equal(np.asarray(t.values).reshape(3, 5), ids)
    with pytest.raises(InvalidInput, match="needs 120"):
        c.from_raw("input_ids", "INT64", [3, 5], ids.tobytes()[:-8])
    with pytest.raises(InvalidInput, match="negative"):
        c.from_raw("input_ids", "INT64", [-1, 5], b"")
    with pytest.raises(InvalidInput, match="unknown datatype"):
        c.from_raw("input_ids", "INT128", [1], b"\x00" * 16)


def test_json_values_nested_and_typed():
    ids = rng.integers(0, 30000, size=(2, 3)).tolist()
    flat = c.from_values("input_ids", "INT64", [2, 3], ids)
    assert np.asarray(flat.values).tolist() == sum(ids, [])
    assert c.from_values("input_ids", "INT64", [2, 3], sum(ids, [])).values.tolist() == sum(ids, [])
    with pytest.raises(InvalidInput, match="element 1"):
        c.from_values("input_ids", "INT64", [2], [1, True])  # a bool is not an integer
    with pytest.raises(InvalidInput, match="element 0"):
        c.from_values("input_ids", "INT64", [1], [1.5])
    with pytest.raises(InvalidInput, match="does not fit"):
        c.from_values("input_ids", "INT64", [1], [2**70])
    with pytest.raises(InvalidInput, match="strings"):
        c.from_values("text", "BYTES", [1], [3])
    with pytest.raises(InvalidInput, match="needs 4"):
        c.from_values("text", "BYTES", [2, 2], ["a", "b", "c"])
    deep = 1
    for _ in range(5000):  # nesting must not hit the recursion limit
        deep = [deep]
    assert c.from_values("x", "INT64", [1], deep).values.tolist() == [1]


def _decode(tensors, params=None, outputs=(), max_inputs=16):
    return c.decode_request(tensors, params or {}, list(outputs), max_inputs, 1000)


def test_decode_text_shapes_and_options():
    texts = _random_texts(4)
    for shape in ([4], [4, 1]):
        t = c.from_values("text", "BYTES", shape, texts)
        d = _decode([t], {"normalize": False, "dimensions": 32, "truncate": False}, [("embedding", {"datatype": "FP16"})])
        assert d.texts == texts and d.token_ids is None and d.output_datatype == "FP16"
        assert (d.options.normalize, d.options.dimensions, d.options.truncate) == (False, 32, False)
    with pytest.raises(InvalidInput, match=r"\[N,1\]"):
        _decode([c.from_values("text", "BYTES", [2, 2], texts)])
    with pytest.raises(PayloadTooLarge, match="at most 3"):
        _decode([c.from_values("text", "BYTES", [4], texts)], max_inputs=3)
    with pytest.raises(InvalidInput, match="'text' element 1"):
        _decode([c.from_values("text", "BYTES", [2], ["ok", "  "])])
    with pytest.raises(InvalidInput, match="UTF-8"):
        _decode([c.from_raw("text", "BYTES", [1], _raw_bytes([b"\xff\xfe"]))])


def test_decode_ids_with_mask_drops_padding():
    lengths = [5, 2, 4]
    ids = rng.integers(1000, 30000, size=(3, 5))
    mask = (np.arange(5)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    d = _decode([c.from_values("input_ids", "INT64", [3, 5], ids.tolist()),
                 c.from_values("attention_mask", "INT64", [3, 5], mask.tolist())])
    assert d.token_ids == [ids[i, :n].tolist() for i, n in enumerate(lengths)]
    d32 = _decode([c.from_raw("input_ids", "INT32", [3, 5], ids.astype("<i4").tobytes())])
    assert d32.token_ids == ids.tolist()
    with pytest.raises(InvalidInput, match="only 0 and 1"):
        _decode([c.from_values("input_ids", "INT64", [1, 2], [5, 6]),
                 c.from_values("attention_mask", "INT64", [1, 2], [1, 2])])
    with pytest.raises(InvalidInput, match="'input_ids' row 0"):
        _decode([c.from_values("input_ids", "INT64", [1, 2], [5, 6]),
                 c.from_values("attention_mask", "INT64", [1, 2], [0, 0])])


@pytest.mark.parametrize("tensors,params,outputs,needle", [
    ([("text", "BYTES", [1], ["a"]), ("input_ids", "INT64", [1, 1], [5])], {}, [], "not both"),
    ([("text", "BYTES", [1], ["a"]), ("text", "BYTES", [1], ["b"])], {}, [], "twice"),
    ([("text", "BYTES", [1], ["a"]), ("attention_mask", "INT64", [1, 1], [1])], {}, [], "goes with"),
    ([("text", "BYTES", [1], ["a"])], {}, [("logits", {})], "unknown output"),
    ([("text", "BYTES", [1], ["a"])], {"datatype": "INT8"}, [], "not supported"),
    ([("text", "BYTES", [1], ["a"])], {"dimensions": True}, [], "dimensions"),
    ([("text", "BYTES", [1], ["a"])], {"normalize": 1}, [], "normalize"),
    ([("token_type_ids", "INT64", [1, 1], [0])], {}, [], "unexpected input"),
])
def test_decode_rejects(tensors, params, outputs, needle):
    with pytest.raises(InvalidInput, match=needle):
        _decode([c.from_values(*t) for t in tensors], params, outputs)


def test_encode_embedding_dtypes():
    v = rng.standard_normal((3, 8)).astype(np.float32)
    assert c.encode_embedding(v, "FP32").dtype == np.float32
    half = c.encode_embedding(v, "FP16")
    assert half.dtype == np.float16 and half.flags.c_contiguous
    np.testing.assert_allclose(half.astype(np.float32), v, rtol=1e-3, atol=1e-3)


def test_stats_counts_and_shape():
    stats = InferenceStats()
    vec = rng.standard_normal((3, 4)).astype(np.float32)
    stats.record_success("m", "1", EmbedResult(vec, 10, "m", "1", [False] * 3), 1000, cache_enabled=True)
    stats.record_success("m", "1", EmbedResult(vec[:1], 3, "m", "1", [True]), 50, cache_enabled=True)
    stats.record_failure("m", "1", 70)
    d = stats.model("m", "1").as_dict()
    assert d["inference_count"] == 4 and d["execution_count"] == 1
    s = d["inference_stats"]
    assert s["success"] == {"count": 2, "ns": 1050} and s["fail"] == {"count": 1, "ns": 70}
    assert s["cache_hit"] == {"count": 1, "ns": 50} and s["cache_miss"] == {"count": 1, "ns": 1000}
    assert d["last_inference"] > 1_700_000_000_000
    assert stats.model("m", "2").as_dict()["inference_count"] == 0  # versions are apart


def test_load_parameters():
    assert c.check_load_parameters({}) is None
    assert c.check_load_parameters({"version": 2, "unload_dependents": False}) == "2"
    for key in ("config", "file:1/model.onnx"):
        with pytest.raises(InvalidInput, match="not supported"):
            c.check_load_parameters({key: "x"})

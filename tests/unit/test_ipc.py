"""runtime/ipc.py without processes: the wire format round-trips and errors keep their type."""

from __future__ import annotations

import numpy as np

from surge.errors import Overloaded
from surge.runtime import ipc_wire as W


def test_bulk_frames_round_trip_and_split_anywhere(bundled_worker, sentences):
    """Many requests in one SUBMITS frame and many answers in one RESULTS frame come back intact,
    however the byte stream is cut (a protocol gets arbitrary chunks)."""
    rng = np.random.default_rng()
    reqs = []
    for rid in rng.choice(1 << 40, 7, replace=False).tolist():
        texts = [sentences[i] for i in rng.choice(len(sentences), int(rng.integers(1, 4)), replace=False)]
        reqs.append((rid, bundled_worker.tokenizer.encode(texts), float(rng.uniform(0, 1e6)) if rid % 2 else None,
                     int(rng.integers(-3, 3)), int(rng.integers(0, 1 << 32))))
    dim = 24
    res = [(r[0], rng.standard_normal((len(r[1]), dim)).astype(np.float32), int(rng.integers(0, 1 << 40)),
            int(rng.integers(0, 1 << 40))) for r in reqs]
    stream = W.encode_submits(reqs) + W.encode_cancel(99) + W.encode_results(res) + W.encode_error(
        7, Overloaded("queue full", retry_after=2.0))
    cuts = sorted(rng.choice(len(stream), 5, replace=False).tolist())
    frames, parts = W.Frames(), []
    for a, b in zip([0] + cuts, cuts + [len(stream)]):
        parts += frames.feed(stream[a:b])
    assert [p[0] for p in parts] == [W.SUBMITS, W.CANCEL, W.RESULTS, W.ERROR]
    got = W.decode_submits(parts[0])
    assert len(got) == len(reqs)
    for (rid, items, dl, pr, md), (rid2, items2, dl2, pr2, md2) in zip(reqs, got):
        assert (rid, dl, pr, md) == (rid2, dl2, pr2, md2) and len(items) == len(items2)
        for a, b in zip(items, items2):
            np.testing.assert_array_equal(a.ids, b.ids)
            np.testing.assert_array_equal(a.type_ids, b.type_ids)
    assert W.decode_cancel(parts[1]) == 99
    for (rid, rows, q, i), (rid2, rows2, q2, i2) in zip(res, W.decode_results(parts[2])):
        assert (rid, q, i) == (rid2, q2, i2)
        np.testing.assert_array_equal(rows, rows2)
    err = W.decode_error(parts[3])
    assert W.error_id(parts[3]) == 7
    assert isinstance(err, Overloaded) and err.retry_after == 2.0 and err.http_status == 429

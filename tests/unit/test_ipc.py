"""runtime/ipc.py without processes: the wire format round-trips, errors keep their type,
and the engine process's shared cache tier answers repeats without compute."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from surge.errors import Overloaded
from surge.runtime import ipc
from surge.runtime import ipc_wire as W
from surge.runtime.batcher import BatcherConfig, DynamicBatcher


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


def test_shared_tier_answers_repeats_without_compute_and_stays_bounded(bundled_worker, sentences):
    items = bundled_worker.tokenizer.encode(sentences[:6])
    pool = ThreadPoolExecutor(1)

    async def main():
        b = DynamicBatcher(bundled_worker.compute, pool, BatcherConfig())
        server = ipc.EngineServer(b, {}, ipc.SharedTier(1 << 20))
        first = await server._rows(items, None, 0, {})
        computed = b.computed_inputs
        again = await server._rows(items[::-1], None, 0, {})
        await b.close()
        return first, again, computed, b.computed_inputs, server.shared

    first, again, computed, after, shared = asyncio.run(main())
    pool.shutdown()
    assert computed == 6 and after == 6  # the repeats were not computed
    np.testing.assert_array_equal(again, first[::-1])
    np.testing.assert_allclose(first, bundled_worker.compute(items), atol=2e-5, rtol=0)
    assert shared.hits == 6
    small = ipc.SharedTier(3 * first[0].nbytes + 200)
    for i, e in enumerate(items):
        small.put(small.key(e), first[i])
    assert small.bytes <= small.max_bytes and len(small._rows) < 6

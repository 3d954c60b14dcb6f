"""runtime/ipc.py without processes: the wire format round-trips, errors keep their type,
and the engine process's shared cache tier answers repeats without compute."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from surge.errors import Overloaded
from surge.runtime import ipc
from surge.runtime.batcher import BatcherConfig, DynamicBatcher


def test_submit_and_error_frames_round_trip(bundled_worker, sentences):
    items = bundled_worker.tokenizer.encode(sentences[:5])
    frame = ipc.encode_submit(42, items, 123.5, 3)
    rid, got, deadline, prio = ipc.decode_submit(frame[4:])
    assert (rid, deadline, prio) == (42, 123.5, 3)
    for a, b in zip(items, got):
        np.testing.assert_array_equal(a.ids, b.ids)
        np.testing.assert_array_equal(a.type_ids, b.type_ids)
    err = ipc.decode_error(ipc.encode_error(7, Overloaded("queue full", retry_after=2.0))[4:])
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

"""The dynamic batcher with the real bundled model: batching, order, drops, overload."""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from surge.errors import DeadlineExceeded, EngineError, Overloaded
from surge.runtime.batcher import BatcherConfig, DynamicBatcher


@pytest.fixture(scope="module")
def pool():
    ex = ThreadPoolExecutor(1)
    yield ex
    ex.shutdown()


@pytest.fixture(scope="module")
def encoded(bundled_worker, sentences):
    return bundled_worker.tokenizer.encode(sentences)


@pytest.fixture(scope="module")
def alone(bundled_worker, encoded):
    """Every sentence computed alone (batch of one): the reference each batched row must equal."""
    return np.stack([bundled_worker.compute([e])[0] for e in encoded[:128]])


def _batcher(worker, pool, **kw) -> DynamicBatcher:
    return DynamicBatcher(worker.compute, pool, BatcherConfig(**kw))


async def _clients(b: DynamicBatcher, encoded, n_clients: int, per_client: int, seed: int = 0):
    rng = random.Random(seed)

    async def client(c):
        got = []
        for _ in range(per_client):
            k = rng.randint(1, 3)  # some callers send several inputs at once
            idx = [rng.randrange(128) for _ in range(k)]
            rows = await b.submit([encoded[i] for i in idx])
            got.append((idx, rows))
        return got

    return [x for r in await asyncio.gather(*(client(c) for c in range(n_clients))) for x in r]


def test_batches_form_under_concurrency_and_rows_match_alone(bundled_worker, pool, encoded, alone):
    delay = 0.005
    b = _batcher(bundled_worker, pool, max_queue_delay_s=delay, max_batch_size=32)
    results = asyncio.run(_clients(b, encoded, 64, 4))
    assert len(results) == 64 * 4
    for idx, rows in results:
        assert rows.shape == (len(idx), alone.shape[1])
        # Each caller gets its own rows, in its order (padding changes the last bits only).
        np.testing.assert_allclose(rows, alone[idx], atol=2e-5, rtol=0)
    sizes = [r.size for r in b.history]
    assert max(sizes) > 1 and np.mean(sizes) > 2
    assert sum(sizes) == b.computed_inputs == sum(len(i) for i, _ in results)
    # The delay bound: once an instance is free and work is queued, a batch
    # leaves within max_queue_delay (plus event-loop scheduling slack).
    slack = 0.05
    assert all(r.free_wait_s <= delay + slack for r in b.history), max(r.free_wait_s for r in b.history)


def test_split_batches_launch_and_collect_on_the_loop_and_wait_on_the_executor(bundled_worker, pool, encoded,
                                                                               alone):
    """The launch / wait / collect path (CUDA engines pooling in their graphs): each caller still
    gets exactly its rows, launch and collect run on the event loop's thread, only wait elsewhere."""
    import threading

    loop_threads, wait_threads = set(), set()

    def launch(items):
        loop_threads.add(threading.get_ident())
        return bundled_worker.compute(items)  # the CPU engine computes at once; a GPU one would return early

    def wait(rows):
        wait_threads.add(threading.get_ident())

    def collect(rows):
        loop_threads.add(threading.get_ident())
        return rows

    b = DynamicBatcher(bundled_worker.compute, pool, BatcherConfig(max_batch_size=32),
                       split=(launch, wait, collect, None))
    main = []

    async def run():
        main.append(threading.get_ident())
        return await _clients(b, encoded, 32, 3, seed=5)

    results = asyncio.run(run())
    for idx, rows in results:
        np.testing.assert_allclose(rows, alone[idx], atol=2e-5, rtol=0)
    assert loop_threads == set(main) and main[0] not in wait_threads and wait_threads


def test_polled_wait_ends_on_the_loop_when_ready_and_falls_back_to_the_executor(bundled_worker, pool, encoded,
                                                                                alone):
    """With `ready` and poll_s: a batch alone in flight that becomes ready within poll_s is waited
    for on the loop (no executor call); one still not ready after poll_s, or launched beside
    another batch, is waited for on the executor. Either way every caller gets exactly its rows."""
    import threading
    import time as _time

    def run_with(delay_s, poll_s, instances=1, clients=16):
        """delay_s: the "GPU" finishes that long after launch; None: only once a thread waits for
        it (so a batch that polling let through was never seen done: independent of speed)."""
        waits, done_at = [], {}

        def launch(items):
            rows = bundled_worker.compute(items)
            key = id(rows)
            done_at[key] = float("inf") if delay_s is None else _time.monotonic() + delay_s
            return key, rows

        def ready(pending):
            return _time.monotonic() >= done_at[pending[0]]

        def wait(pending):
            waits.append(threading.get_ident())
            if delay_s is None:
                done_at[pending[0]] = _time.monotonic()
            _time.sleep(max(0.0, done_at[pending[0]] - _time.monotonic()))

        def collect(pending):
            assert ready(pending)  # never collected before it is done
            return pending[1]

        b = DynamicBatcher(bundled_worker.compute, pool, BatcherConfig(max_batch_size=32, instances=instances),
                           split=(launch, wait, collect, ready), poll_s=poll_s)
        results = asyncio.run(_clients(b, encoded, clients, 2, seed=9))
        for idx, rows in results:
            np.testing.assert_allclose(rows, alone[idx], atol=2e-5, rtol=0)
        return b, waits

    b, waits = run_with(0.002, 1.0)  # ready well within poll_s: all on the loop
    assert b.polled_batches == len(b.history) > 0 and not waits
    b, waits = run_with(None, 0.001)  # still running after poll_s: the executor waits
    assert b.polled_batches == 0 and len(waits) == len(b.history) > 0
    # Two instances: a batch launched beside another in flight is waited for on the executor
    # (each batch is polled or waited, never both); one client alone is always polled.
    b, waits = run_with(0.02, 1.0, instances=2, clients=32)
    assert waits and b.polled_batches + len(waits) == len(b.history)
    b, waits = run_with(0.002, 1.0, instances=2, clients=1)
    assert b.polled_batches == len(b.history) > 0 and not waits


def test_batching_off_runs_every_input_alone(bundled_worker, pool, encoded, alone):
    b = _batcher(bundled_worker, pool, enabled=False)
    results = asyncio.run(_clients(b, encoded, 16, 2, seed=1))
    assert {r.size for r in b.history} == {1}
    for idx, rows in results:
        np.testing.assert_allclose(rows, alone[idx], atol=2e-5, rtol=0)


def test_lone_request_pays_no_delay_and_arrivals_during_compute_share_the_next_batch(
        bundled_worker, pool, encoded, alone):
    """Continuous batching: a huge max delay is an upper bound, never a wait.

    A lone request leaves at once (it would otherwise take 100 s here); inputs
    that arrive while the only instance is busy accumulate and leave together
    the moment it frees."""

    async def main():
        b = _batcher(bundled_worker, pool, max_queue_delay_s=100.0)
        lone = await asyncio.wait_for(b.submit([encoded[0]]), 30)
        big = await _busy(b, encoded)
        rest = [asyncio.ensure_future(b.submit([encoded[i]])) for i in (1, 2, 3)]
        rows = await asyncio.wait_for(asyncio.gather(*rest), 30)
        await big
        return b, lone, rows

    b, lone, rows = asyncio.run(main())
    assert [r.size for r in b.history] == [1, 64, 3]
    np.testing.assert_allclose(lone, alone[:1], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.concatenate(rows), alone[1:4], atol=2e-5, rtol=0)


async def _busy(b: DynamicBatcher, encoded, n: int = 64):
    """Keep the single engine instance busy with a large batch."""
    task = asyncio.ensure_future(b.submit(list(encoded[:n])))
    while not b.history:  # the scheduler dispatches it at the next loop turns
        await asyncio.sleep(0.001)
    return task


def test_cancelled_and_expired_inputs_are_never_computed(bundled_worker, pool, encoded):
    async def main():
        b = _batcher(bundled_worker, pool, max_queue_delay_s=0.001, max_batch_size=64)
        big = await _busy(b, encoded)
        cancelled = asyncio.ensure_future(b.submit(list(encoded[100:110])))
        expiring = asyncio.ensure_future(b.submit(list(encoded[110:115]), deadline=time.monotonic() + 0.01))
        kept = asyncio.ensure_future(b.submit(list(encoded[120:123])))
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(DeadlineExceeded):
            await expiring
        await big
        rows = await kept
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return b, rows

    b, rows = asyncio.run(main())
    assert rows.shape[0] == 3
    assert b.computed_inputs == 64 + 3
    assert b.dropped_inputs == 10 + 5
    assert sum(r.size for r in b.history) == 67


def test_full_queue_raises_overloaded_and_recovers(bundled_worker, pool, encoded):
    async def main():
        b = _batcher(bundled_worker, pool, max_queue_size=8)
        big = await _busy(b, encoded)
        queued = asyncio.ensure_future(b.submit(list(encoded[200:206])))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as info:
            await b.submit(list(encoded[210:214]))
        assert info.value.retry_after and info.value.retry_after >= 1
        await big
        await queued
        return await b.submit(list(encoded[210:214]))  # room again

    assert asyncio.run(main()).shape[0] == 4


def test_priority_runs_first(bundled_worker, pool, encoded):
    async def main():
        b = _batcher(bundled_worker, pool, max_batch_size=1)
        big = await _busy(b, encoded)
        order = []

        async def sub(i, prio):
            await b.submit([encoded[i]], priority=prio)
            order.append(prio)

        tasks = [asyncio.ensure_future(sub(70 + i, p)) for i, p in enumerate([0, 0, 5, 0, 9])]
        await asyncio.gather(big, *tasks)
        return order

    assert asyncio.run(main())[:2] == [9, 5]


def test_length_grouping_cuts_padding(bundled_worker, pool, encoded):
    short = sorted(encoded, key=len)[:24]
    long = sorted(encoded, key=len)[-24:]
    mixed = [x for pair in zip(short, long) for x in pair]

    async def main(grouped_batch):
        b = _batcher(bundled_worker, pool, max_batch_size=grouped_batch)
        big = await _busy(b, encoded, grouped_batch)
        # Every input queued while the engine is busy: the next batches group by length.
        await asyncio.gather(big, *(b.submit([e]) for e in mixed))
        return list(b.history)[1:]

    records = asyncio.run(main(8))
    real = sum(r.real_tokens for r in records)
    cost = sum(r.cost_tokens for r in records)
    arrival_order_cost = sum(max(len(e) for e in mixed[i:i + 8]) * 8 for i in range(0, len(mixed), 8))
    assert cost < arrival_order_cost
    assert 1 - real / cost < 0.5


def test_wrong_row_count_fails_every_caller_loudly(bundled_worker, pool, encoded):
    def drops_a_row(items):
        return bundled_worker.compute(items)[:-1]

    async def main():
        b = DynamicBatcher(drops_a_row, pool, BatcherConfig(max_queue_delay_s=0.05))
        return await asyncio.gather(*(b.submit([encoded[i]]) for i in range(4)), return_exceptions=True)

    outcomes = asyncio.run(main())
    assert all(isinstance(o, EngineError) for o in outcomes), outcomes


def test_service_admission_gives_429_with_retry_after_and_503_when_not_ready(bundled_worker, encoded, sentences):
    from surge.config import BatchingConfig, CacheConfig
    from surge.errors import NotReady
    from surge.runtime.service import ModelService

    async def main():
        svc = ModelService(bundled_worker.spec.name, "1", bundled_worker,
                           batching=BatchingConfig(max_queue_size=8, max_inflight=8), cache=CacheConfig(enabled=False))
        with pytest.raises(NotReady):
            await svc.embed(texts=sentences[:1])
        svc.mark_ready()
        first = asyncio.ensure_future(svc.embed(texts=sentences[:6]))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as info:
            await svc.embed(texts=sentences[6:9])
        assert info.value.retry_after >= 1 and info.value.http_status == 429
        await first
        ok = await svc.embed(texts=sentences[6:9])  # recovered
        await svc.admission.drain()
        await svc.batcher.close()
        return ok

    assert asyncio.run(main()).vectors.shape == (3, 384)


def test_a_waiting_scheduler_counts_its_free_instance_not_as_queue(bundled_worker, pool, encoded):
    """Requests arriving in one event-loop pass while the scheduler waits for work (holding its
    instance's slot): the first batch's inputs are not queue, so only what is past the queue plus
    one batch is refused."""
    b = _batcher(bundled_worker, pool, max_queue_size=4, max_batch_size=4, instances=1)

    async def main():
        first = await b.submit(encoded[:1])  # the scheduler runs, then waits holding the slot
        assert first.shape[0] == 1
        await asyncio.sleep(0.01)
        futs = [b.enqueue(encoded[i:i + 4]) for i in (0, 4)]  # one pass: a batch and a full queue
        with pytest.raises(Overloaded):
            b.enqueue(encoded[8:12])
        rows = await asyncio.gather(*futs)
        await b.close()
        return rows

    rows = asyncio.run(main())
    assert [r.shape[0] for r in rows] == [4, 4]


def test_a_failing_batch_runs_again_caller_by_caller_so_only_the_bad_input_fails(bundled_worker, pool, encoded,
                                                                                  alone):
    """An engine error on one caller's input failed every caller that shared its batch: a result must not depend
    on which requests shared it. The failed batch now runs again one caller at a time."""
    import copy

    poison = copy.copy(encoded[0])  # an input this engine fails on (by identity: its tokens are fine)
    shared = []

    def engine(items):
        if any(item is poison for item in items):
            shared.append(len(items))
            raise RuntimeError("the engine failed on one input")
        return bundled_worker.compute(items)

    async def main():
        b = DynamicBatcher(engine, pool, BatcherConfig(max_queue_delay_s=0.05, max_batch_size=32))
        idx = list(range(1, 9))
        jobs = [b.submit([encoded[i], encoded[i + 10]]) for i in idx[:4]] + [b.submit([poison])] + \
            [b.submit([encoded[i]]) for i in idx[4:]]
        return idx, await asyncio.gather(*jobs, return_exceptions=True)

    idx, outcomes = asyncio.run(main())
    assert max(shared) > 1, shared  # the poison shared a batch with other callers
    assert isinstance(outcomes[4], EngineError) and "failed on one input" in str(outcomes[4])
    good = outcomes[:4] + outcomes[5:]
    assert not [o for o in good if isinstance(o, BaseException)], good
    for i, rows in zip(idx[:4], good[:4]):
        np.testing.assert_allclose(rows, alone[[i, i + 10]], rtol=0, atol=1e-5)
    for i, rows in zip(idx[4:], good[4:]):
        np.testing.assert_allclose(rows, alone[[i]], rtol=0, atol=1e-5)

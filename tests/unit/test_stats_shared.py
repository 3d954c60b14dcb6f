"""KServe statistics whole across front-end processes (runtime/stats.py): each process mirrors its
totals into its own file in the shared directory and a snapshot sums them all."""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace

import numpy as np

from surge.runtime.stats import InferenceStats


def _result(n: int, cached: bool = False, **timings):
    return SimpleNamespace(vectors=np.zeros((n, 2)), cached=[cached] * n, timings=timings)


def _front_end(directory: str, calls: list[tuple[int, int]], failures: int) -> None:
    stats = InferenceStats(directory)  # a real second process: its own pid, its own file
    for n, ns in calls:
        stats.record_success("m", "1", _result(n, compute_infer_ns=ns // 2), ns)
    for _ in range(failures):
        stats.record_failure("m", "1", 7)


def test_a_snapshot_sums_every_process_and_keeps_the_latest_inference(tmp_path):
    rng = np.random.default_rng()
    mine = [(int(rng.integers(1, 5)), int(rng.integers(1_000, 10**9))) for _ in range(int(rng.integers(3, 9)))]
    theirs = [(int(rng.integers(1, 5)), int(rng.integers(1_000, 10**9))) for _ in range(int(rng.integers(3, 9)))]
    here = InferenceStats(str(tmp_path))
    for n, ns in mine:
        here.record_success("m", "1", _result(n, compute_infer_ns=ns // 2), ns)
    here.record_success("m", "1", _result(2, cached=True), 11)  # a cache hit: not an execution
    other = mp.get_context("spawn").Process(target=_front_end, args=(str(tmp_path), theirs, 2))
    other.start()
    other.join(60)
    assert other.exitcode == 0

    snap = here.snapshot("m", "1")
    calls = mine + theirs
    assert snap["inference_count"] == sum(n for n, _ in calls) + 2
    assert snap["execution_count"] == len(calls)
    s = snap["inference_stats"]
    assert s["success"] == {"count": len(calls) + 1, "ns": sum(ns for _, ns in calls) + 11}
    assert s["fail"] == {"count": 2, "ns": 14}
    assert s["compute_infer"] == {"count": len(calls), "ns": sum(ns // 2 for _, ns in calls)}
    assert s["cache_hit"]["count"] == 1
    assert snap["last_inference"] >= here.model("m", "1").last_inference_ms > 0
    # only this process's own counts in its in-memory record; another version is untouched
    assert here.model("m", "1").inference_count == sum(n for n, _ in mine) + 2
    assert here.snapshot("m", "2")["inference_count"] == 0


def test_without_a_shared_directory_a_snapshot_is_this_process_alone():
    stats = InferenceStats()
    stats.record_success("m", "1", _result(3), 5)
    assert stats.snapshot("m", "1") == stats.model("m", "1").as_dict()
    assert stats.snapshot("m", "1")["inference_count"] == 3


def _mirrored(directory) -> np.ndarray | None:
    files = list((directory / "kserve_stats").glob("*.f64"))
    return np.fromfile(files[0], np.float64) if files else None


def test_on_a_running_loop_the_mirror_is_written_once_at_the_end_of_the_pass(tmp_path):
    import asyncio

    stats = InferenceStats(str(tmp_path))
    rng = np.random.default_rng()
    ns = [int(x) for x in rng.integers(1_000, 10**6, size=int(rng.integers(3, 9)))]

    async def one_pass():
        for x in ns:
            stats.record_success("m", "1", _result(2, compute_infer_ns=x), x)
        before = _mirrored(tmp_path)  # nothing stored yet in this pass
        await asyncio.sleep(0)  # the pass ends: its flush runs
        return before, _mirrored(tmp_path)

    before, after = asyncio.run(one_pass())
    assert before is None or before[1] == 0
    assert after[1] == 2 * len(ns) and after[2] == len(ns)  # inference_count, execution_count
    # another reader (a front end's snapshot) sums the file: every request of the pass is there
    reader = InferenceStats(str(tmp_path), tag="reader")
    assert reader.snapshot("m", "1")["inference_stats"]["success"] == {"count": len(ns), "ns": sum(ns)}


def test_a_flush_left_pending_by_a_closed_loop_is_done_on_the_next_one(tmp_path):
    import asyncio

    stats = InferenceStats(str(tmp_path))

    async def record(n):
        stats.record_success("m", "1", _result(n), 5)

    first = asyncio.new_event_loop()

    def record_and_stop():
        stats.record_success("m", "1", _result(3), 5)
        first.stop()  # the pass's flush was scheduled from this callback: it never runs

    first.call_soon(record_and_stop)
    first.run_forever()
    first.close()
    assert _mirrored(tmp_path) is None  # pending on the closed loop
    asyncio.run(record(4))
    assert _mirrored(tmp_path)[1] == 7

"""runtime/outcome.count_failures: each kind of failure counted under its code, the exception kept."""

import asyncio

import pytest

from surge.errors import InvalidInput, NotReady
from surge.runtime.outcome import count_failures


class Recorder:
    def __init__(self):
        self.codes = []

    def failure(self, code):
        self.codes.append(code)


@pytest.mark.parametrize("exc, code", [(InvalidInput("bad"), "invalid_input"), (NotReady("later"), NotReady.code),
                                       (asyncio.CancelledError(), "cancelled"), (KeyError("x"), "internal_error")])
def test_each_failure_is_counted_once_and_raised(exc, code):
    m = Recorder()
    with pytest.raises(type(exc)):
        with count_failures(m):
            raise exc
    assert m.codes == [code]


def test_success_counts_nothing():
    m = Recorder()
    with count_failures(m):
        value = 1 + 1
    assert value == 2 and m.codes == []


def test_inside_a_coroutine_a_cancellation_is_counted():
    m = Recorder()

    async def work():
        with count_failures(m):
            await asyncio.sleep(10)

    async def main():
        task = asyncio.create_task(work())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert m.codes == ["cancelled"]


# ---------------------------------------------------------------- admitted(): the docstring's contract

from types import SimpleNamespace  # noqa: E402

from prometheus_client import CollectorRegistry  # noqa: E402

from surge.errors import Overloaded  # noqa: E402
from surge.runtime.admission import Admission  # noqa: E402
from surge.runtime.metrics import ServiceMetrics  # noqa: E402
from surge.runtime.outcome import admitted  # noqa: E402


def _service(max_items=8, ready=True):
    registry = CollectorRegistry()
    return SimpleNamespace(name="m", version="1", ready=ready, admission=Admission(max_items, "m"),
                           metrics=ServiceMetrics("m", "1", registry)), registry


def _value(registry, name, **labels):
    return registry.get_sample_value(name, {"model": "m", "version": "1", **labels}) or 0.0


def test_admitted_counts_holds_in_flight_and_releases():
    s, reg = _service()
    with admitted(s, 3):
        assert s.admission.inflight == 3 and _value(reg, "surge_inflight_inputs") == 3
    assert s.admission.inflight == 0 and _value(reg, "surge_inflight_inputs") == 0
    assert _value(reg, "surge_requests_total") == 1 and _value(reg, "surge_inputs_total") == 3


def test_admitted_releases_when_the_body_fails_and_counts_the_failure():
    s, reg = _service()
    with pytest.raises(KeyError):
        with admitted(s, 2):
            raise KeyError("boom")
    assert s.admission.inflight == 0
    assert _value(reg, "surge_inflight_inputs") == 0
    assert _value(reg, "surge_request_failures_total", code="internal_error") == 1


def test_not_ready_is_refused_before_the_check_and_takes_no_slot():
    s, _ = _service(ready=False)
    checked = []
    with pytest.raises(NotReady, match="not ready"):
        with admitted(s, 1, check=lambda: checked.append(1)):
            pass
    assert checked == [] and s.admission.inflight == 0


def test_a_failed_check_takes_no_slot():
    s, _ = _service()

    def bad():
        raise InvalidInput("dimensions out of range")

    with pytest.raises(InvalidInput):
        with admitted(s, 4, check=bad):
            pass
    assert s.admission.inflight == 0


def test_a_full_service_refuses_with_overloaded_and_keeps_the_others_slots():
    s, _ = _service(max_items=4)
    with admitted(s, 3):
        with pytest.raises(Overloaded):
            with admitted(s, 2):
                pass
        assert s.admission.inflight == 3  # the refused request took nothing
    assert s.admission.inflight == 0


# ---- AtWrite: counts held in its slots until the answer is written (server/http/delivery.py) -------------------

def _metrics():
    return ServiceMetrics("m", "1", CollectorRegistry())


def _counts(m) -> tuple[float, dict]:
    latency = next(s.value for f in m.registry.collect() for s in f.samples
                   if s.name == "surge_request_latency_seconds_count")
    failures = {s.labels["code"]: s.value for f in m.registry.collect() for s in f.samples
                if s.name == "surge_request_failures_total"}
    return latency, failures


def test_at_write_counts_nothing_until_written_then_all_at_once():
    from surge.runtime.outcome import AtWrite, answered, awaiting, stop_awaiting
    from surge.server.http.frontend import DisconnectWatch

    m, d, recorded = _metrics(), AtWrite(), []

    async def serve():
        token = awaiting(d)
        try:
            answered(m, 0.5)
            answered(m, 0.25)  # a second count: the Delivery's way
            d.record(recorded.append, "first")
            d.record(recorded.append, "second")
        finally:
            stop_awaiting(token)
        assert _counts(m) == (0.0, {}) and recorded == []
        d.written(DisconnectWatch())  # no transport to hold bytes: when_sent says taken at once
        assert _counts(m) == (2.0, {})
        await asyncio.sleep(0)  # the first record: right after the loop pass
        assert sorted(recorded) == ["first", "second"]
        answered(m, 0.1)  # nothing awaited any more here: counted at once
        assert _counts(m)[0] == 3.0

    asyncio.run(serve())


def test_at_write_cut_counts_cancelled_and_records_nothing():
    from surge.runtime.outcome import AtWrite
    from surge.server.http.frontend import DisconnectWatch

    m, d, recorded = _metrics(), AtWrite(), []
    d.answered(m, 0.5)
    d.record(recorded.append, "x")
    waiting = []
    d.written(DisconnectWatch(waiting.append))  # bytes may wait (no transport to ask): the protocol's word
    assert _counts(m) == (0.0, {}) and len(waiting) == 1
    waiting[0](False)  # the connection lost before the buffer drained
    assert _counts(m) == (0.0, {"cancelled": 1.0}) and recorded == []
    d.answered(m, 0.5)  # settled: a late count follows the same fate
    assert _counts(m) == (0.0, {"cancelled": 2.0})


def test_a_quiet_count_is_no_count_even_when_written_later():
    """A load's warm-up may run inside a load request that awaits its delivery: quiet then, counted nowhere."""
    from surge.runtime.outcome import AtWrite, answered, awaiting, stop_awaiting

    m, d = _metrics(), AtWrite()
    token = awaiting(d)
    try:
        with m.quiet():
            answered(m, 0.5)
    finally:
        stop_awaiting(token)
    d.written(None)
    assert _counts(m) == (0.0, {})


@pytest.mark.parametrize("outer", [False, True], ids=["own-delivery", "caller-delivery"])
def test_a_refused_answer_counts_its_refusal_only_and_a_passed_one_its_latency(outer):
    """server/state._checked: the runtime's count of an answered request (runtime/outcome.answered, as the
    service makes it) is held until the protocol's check; a refusal counts its own failure and no latency, a
    pass counts the latency once, with or without a delivery awaited by the caller."""
    from surge.errors import InvalidInput
    from surge.runtime.outcome import AtWrite, answered, awaiting, stop_awaiting
    from surge.server.state import _checked

    async def embedding(m):
        answered(m, 0.5)  # the runtime: computed
        return "rows"

    async def refuse(result):
        raise InvalidInput("too long", param="input")

    async def accept(result):
        assert result == "rows"

    async def serve(m, check):
        d = AtWrite() if outer else None
        token = awaiting(d)
        try:
            try:
                return await _checked(embedding(m), check)
            finally:
                if d is not None:
                    d.written(None)  # the answer (the 400, or the rows) written
        finally:
            stop_awaiting(token)

    m = _metrics()
    with pytest.raises(InvalidInput):
        asyncio.run(serve(m, refuse))
    assert _counts(m) == (0.0, {"invalid_input": 1.0})
    m = _metrics()
    assert asyncio.run(serve(m, accept)) == "rows"
    assert _counts(m) == (1.0, {})

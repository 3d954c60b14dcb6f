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

"""A closed ServiceMetrics takes back the engines (and device pool) it exported, even while another copy is open
under the same model and version labels: the graph-build counts are read from them at scrape time, so a kept list
kept a retired build's engines alive (session 49's CI: `test_gc_freeze`'s unloaded build kept its engine whenever an
earlier test in the same process had left a same-named model open)."""

from __future__ import annotations

import gc
import weakref

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from surge.runtime.metrics import ServiceMetrics


class _Engine:
    def __init__(self, builds: int):
        self.builds, self.builds_after_ready, self.build_s = builds, 0, 0.0


class _Pool:
    def __init__(self, device: str):
        self.device = device

    def stats(self):
        return [{"device": self.device, "served_batches": 1, "served_tokens": 2, "inflight_batches": 0, "instances": 1}]


def _warmup_builds(registry) -> dict:
    from prometheus_client import generate_latest

    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name == "surge_engine_graph_builds_total" and s.labels.get("phase") == "warmup":
                out[(s.labels["model"], s.labels["version"])] = s.value
            if s.name == "surge_device_instances":
                out[("device", s.labels["device"])] = s.value
    return out


def test_a_closed_copy_takes_back_its_engines_while_another_is_open():
    registry = CollectorRegistry()
    first = ServiceMetrics("m", "1", registry)  # e.g. a same-named model elsewhere in the process, left open
    first.watch_engines([_Engine(3)])
    first.watch_devices(_Pool("cpu:a"))
    second = ServiceMetrics("m", "1", registry)  # a build that is retired below
    engine, pool = _Engine(5), _Pool("cpu:b")
    second.watch_engines([engine])
    second.watch_devices(pool)
    assert _warmup_builds(registry) == {("m", "1"): 5, ("device", "cpu:b"): 1}  # the newest open copy's
    refs = weakref.ref(engine), weakref.ref(pool)
    del engine, pool
    second.close()
    gc.disable()  # reference counting alone, as a frozen serving process frees a retired build
    try:
        assert [r() for r in refs] == [None, None], "a closed copy's engines or pool were kept"
    finally:
        gc.enable()
    assert _warmup_builds(registry) == {("m", "1"): 3, ("device", "cpu:a"): 1}  # the copy still open is exported
    first.close()
    assert _warmup_builds(registry) == {}

"""Every replica's metrics on the ingress's /metrics under Ray Serve.

Each replica process records into its own Prometheus registry (engine, batcher,
cache), and Ray Serve gives the ingress no way to address one replica of a
deployment. So each replica pushes its exposition text every `period_s()` to one
small named actor, and the ingress's /metrics merges the latest text of every
replica heard from in the last three periods into its own answer, each sample
labelled `replica="<ray replica id>:<pid>"`. Values are at most one period old;
a replica that is gone drops out after three.

The actor is not detached: it lives with the replica that created it, and if that
replica goes, the next push creates it again (`get_if_exists`), so nothing outlives
the application.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

log = logging.getLogger("surge.distributed")

HUB_NAME = "surge-metrics-hub"
REPLICA_LABEL = "replica"


def period_s() -> float:
    """Seconds between a replica's pushes (`SURGE_RAY_METRICS_PERIOD_S`, default 5)."""
    return float(os.environ.get("SURGE_RAY_METRICS_PERIOD_S", "5"))


class MetricsHub:
    """The latest exposition text of each replica (a Ray actor's body)."""

    def __init__(self):
        self._latest: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self._latest[replica] = (time.monotonic(), text)

    def collect(self, max_age_s: float) -> list[tuple[str, str]]:
        now = time.monotonic()
        for replica in [r for r, (t, _) in self._latest.items() if now - t > max_age_s]:
            del self._latest[replica]
        return sorted((r, text) for r, (_, text) in self._latest.items())


def hub():
    """The hub actor of this Ray namespace, created on first use."""
    import ray

    # One call at a time (the default for a synchronous actor): pushes and collects are tiny.
    return ray.remote(MetricsHub).options(name=HUB_NAME, get_if_exists=True, num_cpus=0).remote()


class Pusher:
    """A daemon thread pushing this process's default registry to the hub (replica side)."""

    def __init__(self, replica: str, every_s: float | None = None):
        self.replica = replica
        self.every_s = every_s or period_s()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="surge-metrics-push", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from surge.runtime.metrics import default_registry

        target = None
        while not self._stop.wait(self.every_s):
            try:
                target = target or hub()
                target.put.remote(self.replica, generate_latest(default_registry()).decode())
            except Exception as exc:  # the hub's owner went away: create it again next time
                log.debug("metrics push from %s failed: %s", self.replica, exc)
                target = None

    def stop(self) -> None:
        self._stop.set()


async def collect_replicas() -> list[tuple[str, str]]:
    """(replica, exposition text) of every live replica (ingress side)."""
    try:
        return await hub().collect.remote(3 * period_s())
    except Exception as exc:  # /metrics still answers with the ingress's own metrics
        log.warning("replica metrics unavailable: %s", exc)
        return []


def merge(own: bytes, sources: list[tuple[str, str]]) -> bytes:
    """One exposition: `own` as it is, then each source's samples with a replica label, family by family."""
    families: dict[str, Metric] = {}

    def add(text: str, replica: str | None) -> None:
        for fam in text_string_to_metric_families(text):
            into = families.get(fam.name)
            if into is None:
                into = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                labels = s.labels if replica is None else {**s.labels, REPLICA_LABEL: replica}
                into.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))

    add(own.decode(), None)
    for replica, text in sources:
        add(text, replica)

    class _Merged:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged())
    return generate_latest(registry)

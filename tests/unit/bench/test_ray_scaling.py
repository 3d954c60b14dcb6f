"""benchmarks/ray_scaling.py measures with `surge bench`'s own definitions (no Ray needed for its load step)."""

from __future__ import annotations

import sys

import pytest

from tests.server_process import ROOT
from tests.unit.bench.tiny_server import TinyServer

sys.path.insert(0, str(ROOT / "benchmarks"))

import ray_scaling


def test_throughput_is_completions_inside_the_window():
    # A one-at-a-time server with 0.2 s a request completes at most 5 requests a second (one more at the window's
    # edge). 8 clients keep 8 requests issued in the 1 s window; counting every one of them (the drain after the
    # window included) reported ~13 req/s, more than the server can do. The window definition cannot exceed it.
    service, duration = 0.2, 1.0
    with TinyServer(service_s=service, serial=True) as srv:
        m = ray_scaling.load(srv.url, ["a query", "another query"], clients=8, duration=duration)
    assert m["errors"] == 0
    assert 0 < m["rps"] <= (duration / service + 1) / duration
    assert m["texts_s"] == pytest.approx(m["rps"])

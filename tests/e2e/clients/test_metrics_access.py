"""/metrics as Prometheus scrapes it: OpenMetrics on request, process metrics, and
access with --api-key (closed; --metrics-public; a separate --metrics-port)."""

from __future__ import annotations

import httpx
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from tests.e2e.clients.conftest import AUTH

OPENMETRICS = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"


def _names(families) -> set[str]:
    return {f.name for f in families}


def test_metrics_need_the_key_unless_opened(main_server, lenient_server):
    assert httpx.get(main_server.url + "/metrics", timeout=30).status_code == 401
    r = httpx.get(lenient_server.url + "/metrics", timeout=30)  # --metrics-public
    assert r.status_code == 200 and "surge_requests" in r.text
    assert httpx.get(lenient_server.url + "/v1/models", timeout=30).status_code == 401  # only /metrics opens


def test_text_and_openmetrics_with_process_metrics(main_server):
    httpx.post(main_server.url + "/embed", json={"inputs": ["count me"]}, headers=AUTH, timeout=60)
    r = httpx.get(main_server.url + "/metrics", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = _names(parse_text(r.text))
    assert {"surge_requests", "process_resident_memory_bytes", "process_cpu_seconds", "python_info"} <= names
    om = httpx.get(main_server.url + "/metrics", headers={**AUTH, "Accept": OPENMETRICS}, timeout=30)
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
    families = {f.name: f for f in parse_openmetrics(om.text)}  # the strict OpenMetrics parser
    assert families["surge_requests"].type == "counter"
    assert sum(s.value for s in families["surge_requests"].samples if s.name == "surge_requests_total") >= 1
    assert families["process_resident_memory_bytes"].samples[0].value > 10e6


def test_separate_metrics_port_needs_no_key(main_server):
    url = f"http://127.0.0.1:{main_server.metrics_port}/metrics"
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200
    assert {"surge_requests", "process_resident_memory_bytes"} <= _names(parse_text(r.text))
    om = httpx.get(url, headers={"Accept": OPENMETRICS}, timeout=30)
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert "surge_requests" in _names(parse_openmetrics(om.text))

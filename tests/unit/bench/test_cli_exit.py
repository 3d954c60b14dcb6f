"""`surge bench run` as a CI step, against a real (tiny, in-test) HTTP server: the exit status says whether
any request failed, overload answers are counted apart, and `-c` caps what is in flight in open loop."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server_process import ROOT
from tests.unit.bench.tiny_server import TinyServer, embed_ok

MEASURED = 60


class _Flaky:
    """Embed request 0 (the CLI's preflight) is answered; later ones: two distinct 500s, 429s and 503s.
    Counted by embed request (the CLI also reads /metrics, answered 404 here), so that each status is known."""

    def __init__(self):
        self.embeds = 0
        self.statuses: dict = {}

    def __call__(self, _, path, body):
        if path != "/embed":
            return 404, b"{}"
        status, payload = _answer(self.embeds, path, body)
        self.embeds += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        return status, payload


def _answer(i, path, body):
    if i % 10 == 3:
        return 500, b'{"error": "boom A"}'
    if i % 10 == 7:
        return 500, b'{"error": "boom B"}'
    if i % 15 == 5:
        return 429, b'{"error": "busy, retry later"}'
    if i % 15 == 10:
        return 503, b'{"error": "unavailable"}'
    return embed_ok(i, path, body)


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "surge.cli.main", "bench", "run", *args, "--no-progress"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)


def _closed_run(srv, tmp_path, *flags):
    # One client, bounded by count: exactly MEASURED requests after the preflight, in the server's order.
    return _bench(srv.url, "-c", "1", "-n", str(MEASURED), "-d", "60", "--warmup", "0",
                  "--json", str(tmp_path / "r.json"), *flags)


def test_some_failed_requests_fail_the_run_with_counts_and_messages(tmp_path):
    flaky = _Flaky()
    with TinyServer(flaky) as srv:
        out = _closed_run(srv, tmp_path)
    seen = flaky.statuses
    text = out.stdout + out.stderr
    assert flaky.embeds == MEASURED + 1 and "Traceback" not in text
    n500, n429, n503 = seen.get(500, 0), seen.get(429, 0), seen.get(503, 0)
    failed, overload = n500 + n429 + n503, n429 + n503
    assert n500 and n429 and n503 and failed < MEASURED  # some failed, not all
    assert out.returncode == 1, text
    # How many failed, how many of them were the server shedding load, and the distinct messages.
    assert f"{failed} of {MEASURED} measured requests failed" in text, text
    assert f"{overload} overload (429/503)" in text, text
    for message in ("boom A", "boom B", "busy, retry later", "unavailable"):
        assert message in text, text
    run = json.loads((tmp_path / "r.json").read_text())["runs"][srv.url][0]
    assert run["error_count"] == failed and run["overload_count"] == overload
    assert run["errors"] == {k: v for k, v in {"http_500": n500, "http_429": n429, "http_503": n503}.items()}


def test_max_error_rate_tolerates_a_fraction(tmp_path):
    with TinyServer(_Flaky()) as srv:
        loose = _closed_run(srv, tmp_path, "--max-error-rate", "0.9")
    flaky = _Flaky()
    with TinyServer(flaky) as srv:
        strict = _closed_run(srv, tmp_path, "--max-error-rate", "0.05")
    failed = sum(v for k, v in flaky.statuses.items() if k != 200)
    assert failed / MEASURED > 0.05
    assert loose.returncode == 0, loose.stdout + loose.stderr
    assert f"{failed} of {MEASURED} measured requests failed" in loose.stdout + loose.stderr  # still said
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "--max-error-rate 0.05" in strict.stdout + strict.stderr


def test_a_clean_run_exits_zero(tmp_path):
    with TinyServer() as srv:
        out = _closed_run(srv, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "failed" not in out.stdout + out.stderr


@pytest.mark.parametrize("value", ["-0.1", "1.5"])
def test_max_error_rate_is_a_fraction(value):
    out = _bench("http://127.0.0.1:1", "--max-error-rate", value)
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "--max-error-rate" in text and "No such option" not in text, text


def test_concurrency_caps_in_flight_requests_in_open_loop(tmp_path):
    # 0.3 s a request, 100 arrivals a second, at most 2 in flight: the server never sees more than 2 at once,
    # and the arrivals that found 2 in flight are reported as dropped (not sent, not queued behind them).
    with TinyServer(service_s=0.3) as srv:
        out = _bench(srv.url, "--mode", "open", "--rate", "100", "-c", "2", "-d", "1", "--warmup", "0",
                     "--json", str(tmp_path / "r.json"))
        peak, served = srv.max_inflight, srv.paths.count("/embed")
    text = out.stdout + out.stderr
    assert peak <= 2, peak
    assert out.returncode == 1, text  # dropped arrivals fail the run (by default: any)
    run = json.loads((tmp_path / "r.json").read_text())["runs"][srv.url][0]
    assert run["max_inflight"] == 2
    assert run["dropped"] > 0 and run["ok"] + run["error_count"] + run["dropped"] == run["requests"]
    assert run["ok"] + run["error_count"] == served - 1  # everything not dropped reached the server (+ preflight)
    assert "dropped" in text


def test_dropped_arrivals_can_be_allowed(tmp_path):
    with TinyServer(service_s=0.3) as srv:
        out = _bench(srv.url, "--mode", "open", "--rate", "100", "-c", "1", "-d", "0.5", "--warmup", "0",
                     "--max-error-rate", "1", "--json", str(tmp_path / "r.json"))
    text = out.stdout + out.stderr
    run = json.loads((tmp_path / "r.json").read_text())["runs"][srv.url][0]
    assert run["dropped"] > 0 and "dropped" in text
    assert out.returncode == 0, text


def test_open_loop_concurrency_is_one_cap_not_a_sweep():
    out = _bench("http://127.0.0.1:1", "--mode", "open", "--rate", "10", "-c", "2,4")
    assert out.returncode == 2 and "--concurrency" in out.stdout + out.stderr, out.stdout + out.stderr

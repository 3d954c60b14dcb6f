"""Reading a real server's /metrics in the tests (prometheus_client's own parser): one model's samples, and
their changes over a test's requests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, model: str, unlabelled: bool = False) -> dict[tuple, float]:
    """{(sample name, labels without model/version): value} of `model`'s series (and, with `unlabelled`, of
    the series that carry no model label), summed over versions."""
    out: dict[tuple, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if s.labels.get("model", model if unlabelled else None) != model:
                continue
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model", "version")))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def delta(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def total(before: dict, after: dict, name: str) -> float:
    """A family's change summed over all its label values."""
    return sum(v for (n, _), v in after.items() if n == name) - sum(v for (n, _), v in before.items() if n == name)

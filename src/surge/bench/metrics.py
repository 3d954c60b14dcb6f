"""Server-side statistics read from a Prometheus `/metrics` page, as before/after deltas.

Names differ between servers, so families are matched by pattern rather than
by one exact name:

- cache hits / misses: counters whose name has `cache` and `hit` / `miss`
  (surge_cache_hits_total, nv_cache_num_hits_per_model, ...), or one counter
  with a `result`/`outcome`/`status` label valued hit / miss;
- cache size: a gauge whose name has `cache` and `entries` (surge_cache_entries), summed;
- batch sizes: a histogram whose name has `batch_size` (mean from _sum/_count,
  distribution from its buckets), or Triton's nv_inference_count /
  nv_inference_exec_count.
"""

from __future__ import annotations

import re

_HIT = re.compile(r"cache.*hit|hit.*cache")
_MISS = re.compile(r"cache.*miss|miss.*cache")
_LABELS = ("result", "outcome", "status", "kind")


def parse(text: str) -> dict:
    """Counter totals and batch-size histogram from Prometheus text (cumulative values)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"cache_hits": 0.0, "cache_misses": 0.0, "batch_sum": 0.0, "batch_count": 0.0, "batch_buckets": {},
           "cache_entries": None, "found": set()}
    triton = {"nv_inference_count": 0.0, "nv_inference_exec_count": 0.0}
    for fam in text_string_to_metric_families(text):
        name = fam.name.lower()
        for s in fam.samples:
            sname = s.name.lower()
            if fam.type == "histogram" and "batch_size" in name:
                if sname.endswith("_sum"):
                    out["batch_sum"] += s.value
                    out["found"].add("batch")
                elif sname.endswith("_count"):
                    out["batch_count"] += s.value
                elif sname.endswith("_bucket"):
                    le = s.labels.get("le", "+Inf")
                    out["batch_buckets"][le] = out["batch_buckets"].get(le, 0.0) + s.value
                continue
            if sname.endswith("_created") or fam.type not in ("counter", "untyped", "gauge"):
                continue
            if name in triton:
                triton[name] += s.value
                continue
            if "cache" not in name:
                continue
            label = next((s.labels[k].lower() for k in _LABELS if k in s.labels), "")
            if fam.type == "gauge":
                if "entries" in name:  # entries held now (summed over tiers): the cache's size
                    out["cache_entries"] = (out["cache_entries"] or 0.0) + s.value
                continue
            if _HIT.search(name) or label in ("hit", "hits"):
                out["cache_hits"] += s.value
                out["found"].add("cache")
            elif _MISS.search(name) or label in ("miss", "misses"):
                out["cache_misses"] += s.value
                out["found"].add("cache")
    if triton["nv_inference_exec_count"] and "batch" not in out["found"]:
        out["batch_sum"] = triton["nv_inference_count"]
        out["batch_count"] = triton["nv_inference_exec_count"]
        out["found"].add("batch")
    return out


def delta(before: dict | None, after: dict | None) -> dict:
    """What changed during a run: cache hit ratio and batch sizes (empty if the server had no such metrics)."""
    if not after:
        return {}
    before = before or {"cache_hits": 0.0, "cache_misses": 0.0, "batch_sum": 0.0, "batch_count": 0.0,
                        "batch_buckets": {}, "found": set()}
    out: dict = {}
    if "cache" in after["found"]:
        hits = after["cache_hits"] - before["cache_hits"]
        misses = after["cache_misses"] - before["cache_misses"]
        out["cache_hits"] = int(hits)
        out["cache_misses"] = int(misses)
        out["cache_hit_ratio"] = hits / (hits + misses) if hits + misses > 0 else None
        if after.get("cache_entries") is not None:
            out["cache_entries"] = int(after["cache_entries"])
    if "batch" in after["found"]:
        n = after["batch_count"] - before["batch_count"]
        out["batches"] = int(n)
        out["batch_size_mean"] = (after["batch_sum"] - before["batch_sum"]) / n if n > 0 else None
        buckets = {le: after["batch_buckets"].get(le, 0.0) - before["batch_buckets"].get(le, 0.0)
                   for le in after["batch_buckets"]}
        if buckets:
            out["batch_size_buckets"] = {le: int(v) for le, v in sorted(buckets.items(), key=lambda kv: _le(kv[0]))}
    return out


def _le(le: str) -> float:
    return float("inf") if le in ("+Inf", "Inf") else float(le)


async def scrape(url: str | None, timeout_s: float = 5.0, api_key: str | None = None) -> dict | None:
    """Parsed /metrics of `url` (a base URL or the metrics URL itself); None when absent or unreachable.
    `api_key`: sent as a bearer token (a server started with --api-key answers /metrics 401 without it,
    unless --metrics-public)."""
    if not url:
        return None
    import aiohttp

    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            async with s.get(url, headers=headers) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        return parse(text)
    except Exception:
        return None

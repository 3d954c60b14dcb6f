"""GPU metrics for Prometheus: utilization, memory, and (Hopper+) SM utilization/occupancy.

`register_gpu_metrics(registry)` adds one collector that reads NVML when
Prometheus scrapes: no background thread, nothing to stop. nvidia-ml-py is
optional and imported lazily; without it or without a GPU nothing is registered.
SM utilization and occupancy come from NVML's GPU performance monitoring (GPM,
Hopper and later), which needs two samples: each scrape reports the interval
since the previous one (the first scrape takes two samples 100 ms apart).
"""

from __future__ import annotations

import threading
import time

_GAUGES = {
    "util": ("surge_gpu_utilization_ratio", "Fraction of time a kernel was running (NVML), 0..1."),
    "mem": ("surge_gpu_memory_used_bytes", "GPU memory in use (NVML)."),
    "sm_util": ("surge_gpu_sm_utilization_ratio", "Fraction of SMs busy over the scrape interval (NVML GPM), 0..1."),
    "sm_occ": ("surge_gpu_sm_occupancy_ratio", "Resident warps over the SMs' maximum (NVML GPM), 0..1."),
}


class GpuCollector:
    def __init__(self, nvml, handles: list):
        self.nvml = nvml
        self.handles = handles
        self._lock = threading.Lock()
        self._prev: dict[int, object] = {}
        self.gpm = [self._gpm_supported(h) for h in handles]

    def _gpm_supported(self, handle) -> bool:
        try:
            return bool(self.nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
        except Exception:  # older driver, older GPU, or no GPM in this nvidia-ml-py
            return False

    def _gpm(self, i: int, handle) -> dict[str, float]:
        n = self.nvml
        with self._lock:
            prev = self._prev.get(i)
            if prev is None:
                prev = n.nvmlGpmSampleAlloc()
                n.nvmlGpmSampleGet(handle, prev)
                time.sleep(0.1)
            cur = n.nvmlGpmSampleAlloc()
            n.nvmlGpmSampleGet(handle, cur)
            m = n.c_nvmlGpmMetricsGet_t()
            m.version = n.NVML_GPM_METRICS_GET_VERSION
            m.numMetrics = 2
            m.sample1, m.sample2 = prev, cur
            m.metrics[0].metricId = n.NVML_GPM_METRIC_SM_UTIL
            m.metrics[1].metricId = n.NVML_GPM_METRIC_SM_OCCUPANCY
            n.nvmlGpmMetricsGet(m)
            n.nvmlGpmSampleFree(prev)
            self._prev[i] = cur
            return {"sm_util": m.metrics[0].value / 100.0, "sm_occ": m.metrics[1].value / 100.0}

    def sample(self) -> dict[int, dict[str, float]]:
        out = {}
        for i, h in enumerate(self.handles):
            vals = {}
            try:
                vals["util"] = self.nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
                vals["mem"] = float(self.nvml.nvmlDeviceGetMemoryInfo(h).used)
            except Exception:
                pass
            if self.gpm[i]:
                try:
                    vals.update(self._gpm(i, h))
                except Exception:
                    self.gpm[i] = False  # e.g. GPM not permitted in this container: stop asking
            out[i] = vals
        return out

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        samples = self.sample()
        for key, (name, doc) in _GAUGES.items():
            fam = GaugeMetricFamily(name, doc, labels=["gpu"])
            for i, vals in samples.items():
                if key in vals:
                    fam.add_metric([str(i)], vals[key])
            yield fam


def register_gpu_metrics(registry) -> GpuCollector | None:
    """Register the GPU collector on a prometheus_client CollectorRegistry; None where there is no GPU/NVML."""
    try:
        import pynvml as nvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    except Exception:
        return None
    if not handles:
        return None
    collector = GpuCollector(nvml, handles)
    registry.register(collector)
    return collector

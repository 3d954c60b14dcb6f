"""Replicas on several devices: each batch goes to the least-loaded one.

`DevicePool` has EnginePool's interface (`engines`, `capabilities`, `run`,
`close`), so ModelWorker and ModelService use it unchanged. Load is the number
of tokens in flight on a device (a batch's padded tokens for padded engines:
that is the work the device does); a device can hold several engine
instances (`instances` per device, each with its own stream), and a batch
takes a free instance of the chosen device. Ties go to the device that has
served the fewest tokens so far, so that sequential traffic alternates.

The choice and the bookkeeping happen under one lock; the run itself does not
hold it, so devices compute concurrently.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from surge.engines.base import Engine
from surge.types import TokenBatch


@dataclass
class DeviceLoad:
    device: str
    engines: list[Engine]
    busy: list[bool] = field(default_factory=list)
    inflight_tokens: int = 0
    inflight_batches: int = 0
    served_batches: int = 0
    served_tokens: int = 0

    def __post_init__(self):
        self.busy = [False] * len(self.engines)

    @property
    def free(self) -> bool:
        return not all(self.busy)


class DevicePool:
    def __init__(self, engines: list[Engine], devices: list[str] | None = None):
        """engines[i] runs on devices[i] (default: its capabilities' device)."""
        if not engines:
            raise ValueError("at least one engine instance is needed")
        if devices is not None and len(devices) != len(engines):
            raise ValueError("one device label per engine")
        self.engines = engines
        labels = devices or [e.capabilities.device for e in engines]
        self.devices: list[DeviceLoad] = []
        by_label: dict[str, DeviceLoad] = {}
        for label, e in zip(labels, engines):
            d = by_label.get(label)
            if d is None:
                d = by_label[label] = DeviceLoad(label, [])
                self.devices.append(d)
            d.engines.append(e)
        for d in self.devices:
            d.busy = [False] * len(d.engines)
        self._cond = threading.Condition()

    @property
    def capabilities(self):
        return self.engines[0].capabilities

    def _acquire(self, tokens: int) -> tuple[DeviceLoad, int]:
        with self._cond:
            while True:
                free = [d for d in self.devices if d.free]
                if free:
                    d = min(free, key=lambda d: (d.inflight_tokens, d.served_tokens))
                    slot = d.busy.index(False)
                    d.busy[slot] = True
                    d.inflight_tokens += tokens
                    d.inflight_batches += 1
                    return d, slot
                self._cond.wait()  # every instance of every device is running: the next release wakes us

    def _release(self, d: DeviceLoad, slot: int, tokens: int) -> None:
        with self._cond:
            d.busy[slot] = False
            d.inflight_tokens -= tokens
            d.inflight_batches -= 1
            d.served_batches += 1
            d.served_tokens += tokens
            self._cond.notify()

    def run(self, batch: TokenBatch) -> np.ndarray:
        tokens = batch.padded_tokens
        d, slot = self._acquire(tokens)
        try:
            return d.engines[slot].run(batch)
        finally:
            self._release(d, slot, tokens)

    def stats(self) -> list[dict]:
        with self._cond:
            return [{"device": d.device, "instances": len(d.engines), "inflight_tokens": d.inflight_tokens,
                     "inflight_batches": d.inflight_batches, "served_batches": d.served_batches,
                     "served_tokens": d.served_tokens} for d in self.devices]

    def close(self) -> None:
        for e in self.engines:
            e.close()

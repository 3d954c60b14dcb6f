"""Decoder models of a repository under `--workers N`.

The engine process (cli/workers_engine.py) builds each loaded version of a decoder as a `HubBuild`:
its engine and engine loop on a thread of their own, behind a hub on a socket of their own
(runtime/generate_hub.py); the version's CATALOG entry (cli/workers_repo.ModelSlots) names that
socket, and every front end serves it with a GenerateService over a HubClient, as with one decoder
under --workers.

Zero downtime across processes, as for embedding models: a reload's new build listens and is in the
CATALOG before the old one leaves it. A front end takes the old build out of its routing when the
CATALOG changes, lets its streams finish, then closes its connection (`retire`); the engine process
closes the old build once no front end is connected to it any more (bounded by the request timeout),
so no stream in flight is cut and a front end that saw the new CATALOG late still had the old build
to send to.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from pathlib import Path

log = logging.getLogger("surge.workers")


class HubBuild:
    """One decoder version in the engine process: what ModelRepository reads of a service (name,
    version, task, mark_ready, warmup_request, close) and the CATALOG's entry (`catalog_entry`)."""

    task = "generate"

    def __init__(self, spec, version: str, engine_cfg, generation, sock_dir: str, request_timeout_s: float):
        from surge.runtime.generate_hub import start_hub

        self.name, self.version, self.spec_dir = spec.name, version, str(spec.path)
        self.request_timeout_s = request_timeout_s
        self.ready = False
        path = os.path.join(sock_dir, f"gen-{secrets.token_hex(6)}.sock")
        self._h = start_hub(spec, spec.name, version, engine_cfg, generation, path)
        self._thread = threading.Thread(target=self._h.core.run, args=(self._h.hub, self._h.hub), daemon=True,
                                        name=f"surge-{spec.name}-{version}-generate")
        self._thread.start()

    def mark_ready(self) -> None:
        self.ready = True

    async def warmup_request(self) -> None:
        """Nothing more: the engine warmed every bucket when it was built (start_hub); requests reach
        it from the front ends."""

    def catalog_entry(self) -> dict:
        return {"name": self.name, "version": self.version, "spec_dir": self.spec_dir, "hub": self._h.path,
                "generation": self._h.generation.model_dump(mode="json")}

    def connected(self) -> int:
        return len(self._h.hub.fronts)

    async def close(self) -> None:
        """Once no front end is connected (they leave after their streams on it end), or after the
        request timeout: end the loop (what still runs fails as unloaded) and free the engine."""
        deadline = time.monotonic() + self.request_timeout_s + 5.0
        while self.connected() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.ready = False
        os.write(self._h.stop_w, b"x")
        await asyncio.to_thread(self._thread.join, 30.0)
        self._h.hub.close()
        os.close(self._h.stop_w)
        if os.path.exists(self._h.path):
            os.unlink(self._h.path)
        self._h = None  # the engine's memory goes with the last reference


def front_generator(config, entry: dict):
    """One CATALOG generator entry as a front end's GenerateService over the build's hub (called on
    the front end's event loop, which reads the hub's reports from now on)."""
    from surge.config import GenerationConfig
    from surge.runtime.generate_hub import HubClient
    from surge.runtime.generate_service import service_over

    client = HubClient(entry["hub"], timeout_s=30.0)
    gen = GenerationConfig.model_validate(entry["generation"])
    service = service_over(client, Path(entry["spec_dir"]), entry["name"], entry["version"], gen,
                           config.limits.request_timeout_s)
    service.bind_loop(asyncio.get_running_loop())
    return service


async def retire(service) -> None:
    """A front end's generator taken out of routing: its streams finish (at most the request timeout),
    then it leaves the build."""
    deadline = time.monotonic() + service.request_timeout_s + 5.0
    while service.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    try:
        await service.close()
    except Exception:  # noqa: BLE001 - the build is gone already; nothing to leave
        log.exception("front end: closing %s version %s", service.name, service.version)

"""Decoder models of a repository under `--workers N`.

The engine process (cli/workers_engine.py) builds each loaded version of a decoder as a `HubBuild`:
its engine and engine loop in a process of their own, behind a hub on a socket of their own
(runtime/generate_hub.py); the version's CATALOG entry (cli/workers_repo.ModelSlots) names that
socket, and every front end serves it with a GenerateService over a HubClient, as with one decoder
under --workers.

Zero downtime across processes, as for embedding models: a reload's new build listens and is in the
CATALOG before the old one leaves it. A front end takes the old build out of its routing when the
CATALOG changes, lets its streams finish, then closes its connection (`retire`); the old build's
process ends once no front end is connected to it any more (a drain, bounded by the request timeout),
so no stream in flight is cut and a front end that saw the new CATALOG late still had the old build
to send to.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("surge.workers")


# a build's engine process that dies is started again after these delays (the last one repeats)
RESTART_DELAYS_S = (0.5, 2.0, 8.0)


class HubBuild:
    """One decoder version of the engine process: what ModelRepository reads of a service (name,
    version, task, mark_ready, warmup_request, close) and its CATALOG entry (`catalog_entry`).

    The version's engine loop runs in a process of its own (`python -m surge.cli.workers_generate`),
    as a decoder's loop does under --workers with one model and on a GPU without --workers: the engine
    process's event loop, which batches every embedding front end's requests, never holds it up at the
    GIL. A build process that dies is started again on the same socket (its front ends reconnect);
    one whose engine process dies sees its parent gone and exits."""

    task = "generate"

    def __init__(self, spec, version: str, engine_cfg, generation, sock_dir: str, request_timeout_s: float,
                 start_timeout_s: float = 1800.0):
        from surge.runtime.loader import generate_settings

        self.name, self.version, self.spec_dir = spec.name, version, str(spec.path)
        self.request_timeout_s = request_timeout_s
        self.ready = False
        self.path = os.path.join(sock_dir, f"gen-{secrets.token_hex(6)}.sock")
        _, _, self.generation = generate_settings(spec, engine_cfg, generation)  # what front ends build with
        self._args = {"spec_dir": self.spec_dir, "name": self.name, "version": version, "path": self.path,
                      "engine": engine_cfg.model_dump(mode="json", exclude_unset=True),  # what was set stays set
                      "generation": generation.model_dump(mode="json"),
                      "drain_s": request_timeout_s + 5.0}
        self._closing = False
        self._proc = self._start(False)
        deadline = time.monotonic() + start_timeout_s
        while not os.path.exists(self.path):
            if self._proc.poll() is not None:
                from surge.errors import ConfigError

                raise ConfigError(f"{self.spec_dir}: the decoder's engine process exited with code "
                                  f"{self._proc.returncode} while loading")
            if time.monotonic() > deadline:
                self._proc.kill()
                raise TimeoutError(f"{self.spec_dir}: the decoder's engine process did not start in time")
            time.sleep(0.05)
        self._watch = threading.Thread(target=self._keep_up, daemon=True, name=f"surge-{self.name}-{version}-watch")
        self._watch.start()

    def _start(self, restarted: bool):
        from surge.runtime.generate_process import child_env

        args = json.dumps({**self._args, "restarted": restarted})
        return subprocess.Popen([sys.executable, "-m", "surge.cli.workers_generate", args], env=child_env())

    def _keep_up(self) -> None:
        attempt = 0
        while True:
            code = self._proc.wait()
            from surge.runtime.metrics import process_gone

            process_gone(self._proc.pid)  # else its last running / KV gauges stay on /metrics
            if self._closing:
                return
            delay = RESTART_DELAYS_S[min(attempt, len(RESTART_DELAYS_S) - 1)]
            log.error("model %s version %s: its engine process exited (%s); starting it again in %.1f s",
                      self.name, self.version, code, delay)
            time.sleep(delay)
            if self._closing:
                return
            attempt += 1
            self._proc = self._start(True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def mark_ready(self) -> None:
        self.ready = True

    async def warmup_request(self) -> None:
        """Nothing more: the engine warmed every bucket before it listened (start_hub); requests reach
        it from the front ends."""

    def catalog_entry(self) -> dict:
        return {"name": self.name, "version": self.version, "spec_dir": self.spec_dir, "hub": self.path,
                "generation": self.generation.model_dump(mode="json")}

    async def close(self) -> None:
        """Drain: the build's process ends once no front end is connected (they leave after their
        streams on it end), or after the request timeout (what still runs then fails as unloaded)."""
        import signal

        self._closing = True
        self.ready = False
        proc = self._proc
        if proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
            try:
                await asyncio.to_thread(proc.wait, self._args["drain_s"] + 30.0)
            except subprocess.TimeoutExpired:  # it did not end: it goes now
                proc.kill()
                await asyncio.to_thread(proc.wait, 10.0)
        from surge.runtime.metrics import process_gone

        process_gone(proc.pid)  # here too: the watcher thread may not have run yet
        if os.path.exists(self.path):
            os.unlink(self.path)


def _child_main(args_json: str) -> int:
    """A decoder version's engine process: build, listen, run the loop; SIGUSR1 drains, SIGTERM stops,
    and a parent that is gone stops it too."""
    import signal
    from dataclasses import replace

    from surge.config import EngineConfig, GenerationConfig
    from surge.models import load_model_spec
    from surge.runtime.generate_hub import DRAIN, STOP, start_hub

    a = json.loads(args_json)
    engine_cfg = EngineConfig.model_validate(a["engine"])
    if engine_cfg.threads:
        import torch

        torch.set_num_threads(engine_cfg.threads)
    spec = replace(load_model_spec(a["spec_dir"]), name=a["name"])
    parent = os.getppid()
    h = start_hub(spec, a["name"], a["version"], engine_cfg, GenerationConfig.model_validate(a["generation"]),
                  a["path"], a.get("restarted", False), a["drain_s"])
    signal.signal(signal.SIGTERM, lambda *_: os.write(h.stop_w, STOP))
    signal.signal(signal.SIGUSR1, lambda *_: os.write(h.stop_w, DRAIN))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides

    def orphaned() -> None:  # the engine process died (SIGKILL): nobody would close this one
        while os.getppid() == parent:
            time.sleep(1.0)
        os.write(h.stop_w, STOP)

    threading.Thread(target=orphaned, daemon=True).start()
    try:
        h.core.run(h.hub, h.hub)
    finally:
        h.hub.close()
        if os.path.exists(a["path"]):
            os.unlink(a["path"])
    return 0


# a front end's wait for one connection to a build (its handshake included): the build may be busy
# starting again, or stalled; SURGE_HUB_CONNECT_S shortens it (tests stall a build on purpose)
def connect_timeout_s() -> float:
    return float(os.environ.get("SURGE_HUB_CONNECT_S", "30"))


async def front_generator(config, entry: dict):
    """One CATALOG generator entry as a front end's GenerateService over the build's hub. The connect
    runs on a thread: the event loop keeps serving every other model while the build answers (or
    does not: the attempt fails after connect_timeout_s and FrontModels tries again)."""
    from surge.config import GenerationConfig
    from surge.runtime.generate_hub import HubClient
    from surge.runtime.generate_service import attach_shared_cache
    from surge.runtime.generate_load import service_over

    client = await _on_thread(lambda: HubClient(entry["hub"], connect_timeout_s()))
    try:
        gen = GenerationConfig.model_validate(entry["generation"])
        service = service_over(client, Path(entry["spec_dir"]), entry["name"], entry["version"], gen,
                               config.limits.request_timeout_s)
        attach_shared_cache(service, config.cache)
    except BaseException:
        client.close()  # the build would keep this front end's connection open otherwise
        raise
    service.bind_loop(asyncio.get_running_loop())  # read the hub's reports from now on
    return service


async def _on_thread(connect):
    """`connect()`'s HubClient, made on a daemon thread of its own: not asyncio.to_thread's pool, whose
    threads the front end's exit waits for (an attempt on a stalled build lasts connect_timeout_s)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def deliver(client, exc) -> None:
        if fut.cancelled():  # nobody waits for it any more (unloaded, or the front end stops)
            if client is not None:
                client.stop()
        elif exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(client)

    def run() -> None:
        try:
            client, exc = connect(), None
        except Exception as e:  # noqa: BLE001 - handed to the awaiting task
            client, exc = None, e
        try:
            loop.call_soon_threadsafe(deliver, client, exc)
        except RuntimeError:  # the loop is closed: the front end is exiting
            if client is not None:
                client.conn.close()

    threading.Thread(target=run, daemon=True, name="surge-hub-connect").start()
    return await fut


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


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))

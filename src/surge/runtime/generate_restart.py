"""A GenerateService's engine process that exits: every stream in flight fails at once, the model answers
503 (not ready), and a new engine process is started, a bounded number of times.

A mixin of GenerateService (runtime/generate_service.py), apart from it because only a remote engine
loop (runtime/generate_process.py, generate_hub.py) can die on its own. Needs the service's `name`,
`engine`, `ready`, `adapters`, `metrics`, `_closed`, `_restarting`, `_restart_task`, `_restarts`,
`_loop`, `_engine_metrics`, `_on_message`, `_send` and `_fail_streams`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from surge.errors import EngineError
from surge.runtime.generate_core import EngineState

log = logging.getLogger("surge.generate")

# An engine process that exits is started again after these delays, at most RESTART_LIMIT times within
# RESTART_WINDOW_S (GenerateService._on_exit).
RESTART_DELAYS_S = (0.5, 2.0, 8.0)
RESTART_LIMIT = 3
RESTART_WINDOW_S = 600.0


class EngineRestarts:
    def _on_exit(self) -> None:
        """The engine process's connection ended: closed by us, or the process died. Then every stream
        in flight fails now rather than at its deadline, the model answers 503 (not ready) and a new
        child is started (RESTART_DELAYS_S apart at most RESTART_LIMIT times in RESTART_WINDOW_S: a child
        that cannot stay up leaves the model not ready)."""
        if self._closed or self._restarting:
            return
        self.ready = False
        code = self.engine.exit_code(wait=0.2)  # on the event loop: a bounded wait for the status
        how = f" (code {code})" if code is not None else ""  # a shared engine process's code is its supervisor's
        log.error("model '%s': its engine process exited%s", self.name, how)
        self._fail_streams(EngineError(f"model '{self.name}': its engine process exited{how}"))
        self._restarting = True
        self._restart_task = asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        old = self.engine
        try:
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < RESTART_WINDOW_S]
            # A shared engine process (--workers, a repository's decoder build) is its supervisor's to
            # start again, and it may take longer to load than any fixed number of attempts here waits
            # (a large model: minutes): no limit then, the last delay repeats until it answers or this
            # service closes. An engine process of our own gets RESTART_DELAYS_S's attempts.
            limit = getattr(old, "restart_limit", RESTART_LIMIT)
            attempt = 0
            while not self._closed:
                if limit is not None and (len(self._restarts) >= limit or attempt >= len(RESTART_DELAYS_S)):
                    break
                await asyncio.sleep(RESTART_DELAYS_S[min(attempt, len(RESTART_DELAYS_S) - 1)])
                attempt += 1
                try:
                    engine = await asyncio.to_thread(old.respawn)
                except Exception as exc:  # the load failed: the next delay, or give up
                    log.error("model '%s': starting its engine process again failed: %s", self.name, exc)
                    continue
                if self._closed:  # unloaded meanwhile
                    await asyncio.to_thread(engine.close)
                    return
                old.stop()
                self.engine, self._state, self._sent = engine, EngineState(), 0
                engine.attach(self._loop, self._on_message, self._on_exit)
                for a in self.adapters.values():  # the new engine knows no adapters
                    self._send(("adapter", a.uid, str(a.path), a.name))
                self._restarts.append(time.monotonic())
                if self._engine_metrics:
                    self.metrics.restarts.inc()
                self.ready = True
                log.warning("model '%s': its engine process runs again (pid %s)", self.name, engine.pid)
                return
            if not self._closed:
                log.error("model '%s': its engine process stays down; the model is not ready", self.name)
        finally:
            self._restarting = False

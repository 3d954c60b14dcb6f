"""Start a real `surge serve` process on free ports for end-to-end tests.

A thin layer over surge.bench.servers.ServerProc (process group, readiness
wait, log capture, clean stop), which the side-by-side benchmarks use too.
"""

from __future__ import annotations

import ssl
import sys
import time
from pathlib import Path

import httpx

from surge.bench.servers import ServerProc, free_port

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["ROOT", "ServerProcess", "free_port", "fresh_client"]

# Made once: an httpx client made without one loads the CA bundle, 52-85 ms of CPU on CI's 2 cores (benchmarks/startup_cpu.py), which
# tests that open a fresh connection per request (to reach every front end) paid hundreds of times.
_TLS = ssl.create_default_context()


def fresh_client(base_url: str = "", **kw) -> httpx.Client:
    """A new httpx client (so a new connection) that costs no CA bundle load."""
    return httpx.Client(base_url=base_url, verify=_TLS, **kw)


class ServerProcess(ServerProc):
    """`with ServerProcess("--no-batching") as srv: httpx.get(srv.url + "/health")`."""

    def __init__(self, *args: str, env: dict | None = None, ready_timeout: float = 180.0, grpc: bool = False):
        port = free_port()
        self.grpc_port = free_port() if grpc else 0
        argv = [sys.executable, "-m", "surge.cli.main", "serve", "--port", str(port),
                "--grpc-port", str(self.grpc_port), *args]
        super().__init__("surge-serve", argv, port, ready_timeout_s=ready_timeout, env=env, cwd=ROOT)

    def wait_ready(self, status=None) -> "ServerProcess":
        """Ready, and under --workers N every front end ready (each prints so once its models are in): the
        probe's one connection reaches one front end, and another may still be loading."""
        super().wait_ready(status)
        argv = self.argv if hasattr(self, "argv") else []
        if "--workers" in argv:
            n = argv[argv.index("--workers") + 1]
            want = int(n) if n.isdigit() else 0
            deadline = time.monotonic() + self.ready_timeout_s
            while self.output(tail=1 << 20).count("ready, serving") < want and time.monotonic() < deadline:
                time.sleep(0.1)
        return self

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def children_by_role(srv) -> dict[str, list]:
    """A `--workers` server's processes by role ("engine", "front"): psutil.Process objects."""
    import psutil

    out: dict[str, list] = {"engine": [], "front": []}
    for p in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "surge.cli.workers" in cmd:
            out[cmd[cmd.index("surge.cli.workers") + 1]].append(p)
    return out


def wait_ready(srv, timeout=120.0, streak=10) -> None:
    """Until the server's /ready answers 200 on `streak` fresh connections in a row (TimeoutError after
    `timeout` s): under --workers each connection lands on any front end, and after an engine restart each
    front end is ready once it has reconnected, one possibly after another (a single 200 let a CI run's next
    request reach the other one, still 503)."""
    end = time.monotonic() + timeout
    run = 0
    while time.monotonic() < end:
        try:
            ok = httpx.get(srv.url + "/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            ok = False
        run = run + 1 if ok else 0
        if run >= streak:
            return
        time.sleep(0.05 if ok else 0.2)
    raise TimeoutError("not ready again")

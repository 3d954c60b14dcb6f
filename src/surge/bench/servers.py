"""Starting servers as processes for side-by-side benchmarks (and stopping them, always)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    """A server command started in its own process group, ready once `ready_path` answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, ready_path: str = "/ready",
                 ready_timeout_s: float = 300.0, env: dict | None = None, cwd: str | Path | None = None):
        self.name = name
        self.argv = argv
        self.port = port
        self.ready_path = ready_path
        self.ready_timeout_s = ready_timeout_s
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"bench-{name}-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, status=None, wait: bool = True) -> "ServerProc":
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     cwd=self.cwd, start_new_session=True)
        if wait:
            self.wait_ready(status)
        return self

    def wait_ready(self, status=None) -> "ServerProc":
        import httpx

        deadline = time.monotonic() + self.ready_timeout_s
        # One client for every probe: each new httpx client loads the CA bundle (52-85 ms of CPU on a 2-core VM,
        # benchmarks/startup_cpu.py), which a probe every 0.3 s took from the server starting beside it.
        with httpx.Client(timeout=2) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.output()}")
                try:
                    if client.get(self.url + self.ready_path).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if status is not None:
                    status.update(f"[bold]starting {self.name}[/] ({int(deadline - time.monotonic())} s left)")
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {self.ready_timeout_s:.0f} s:\n{self.output()}")

    def output(self, tail: int = 4000) -> str:
        try:
            return Path(self.log.name).read_text()[-tail:]
        except OSError:
            return ""

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> "ServerProc":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def surge_serve_argv(port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "surge.cli.main", "serve", "--port", str(port), "--grpc-port", "0", *flags]

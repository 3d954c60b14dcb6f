"""Start a real `surge serve` process on free ports for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`with ServerProcess("--no-batching") as srv: httpx.get(srv.url + "/health")`."""

    def __init__(self, *args: str, env: dict | None = None, ready_timeout: float = 180.0, grpc: bool = False):
        self.port = free_port()
        self.grpc_port = free_port() if grpc else 0
        self.args = list(args)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self) -> "ServerProcess":
        import tempfile

        self.log = tempfile.NamedTemporaryFile("w+", prefix="surge-serve-", suffix=".log", delete=False)
        self.log_path = self.log.name
        cmd = [sys.executable, "-m", "surge.cli.main", "serve", "--port", str(self.port),
               "--grpc-port", str(self.grpc_port), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                     start_new_session=True)
        self.wait_ready()
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"surge serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"surge serve not ready after {self.ready_timeout}s:\n{self.output()}")

    def output(self) -> str:
        try:
            return Path(self.log_path).read_text()[-5000:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

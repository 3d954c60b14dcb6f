"""A real redis-server on a free port, for the shared cache tier's tests.

Tests that use the `redis_server` fixture are skipped (with the reason) when
the redis-server binary is not installed (`apt-get install -y redis-server`).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time

import pytest

from tests.server_process import free_port


@contextlib.contextmanager
def running_redis(binary: str):
    """A redis-server on a free loopback port, without persistence; yields its URL."""
    import redis

    port = free_port()
    workdir = tempfile.mkdtemp(prefix="surge-redis-")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
    try:
        yield url
    finally:
        client.close()
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server():
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server); shared-tier tests skipped")
    with running_redis(binary) as url:
        yield url

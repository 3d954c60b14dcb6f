"""The supervisor of `surge serve --workers 2` (cli/workers.py) never leaves processes or shared memory behind.

- a port already in use fails at once with a message that names it, before any engine process loads
  the model, and nothing of the server is left (no process, no /dev/shm table, no socket directory);
- a supervisor killed outright (SIGKILL: the OOM killer, `kill -9`) takes its children with it: no
  orphaned front end keeps answering on the port, no orphaned engine process keeps the model loaded;
  the next supervisor removes the /dev/shm directory it could not.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys

import httpx
import psutil
import pytest

from tests.server_process import ROOT, ServerProcess, children_by_role

pytestmark = pytest.mark.timeout(300)

ARGS = ("--workers", "2", "--engine", "torch", "--device", "cpu", "--max-batch-size", "8")


def _session(sid: int) -> list[psutil.Process]:
    """The processes still running in session `sid` (a server started with start_new_session)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return out


def test_a_port_in_use_fails_at_once_and_leaves_nothing(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    log = open(tmp_path / "log", "w+")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path)}  # its socket directory goes here
    proc = subprocess.Popen([sys.executable, "-m", "surge.cli.main", "serve", "--port", str(port), "--grpc-port", "0",
                             *ARGS], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=240)
        left = _session(proc.pid)
        out = (tmp_path / "log").read_text()
        assert rc != 0
        assert f"127.0.0.1:{port}" in out and "in use" in out, out[-2000:]
        assert "starting 1 engine process" not in out  # refused before loading anything
        assert not left, [p.cmdline()[:4] for p in left]
        assert not glob.glob(f"/dev/shm/surge-cache-{proc.pid}-*")
        assert not [p for p in tmp_path.iterdir() if p.name != "log"]
    finally:
        for p in _session(proc.pid):
            p.kill()
        taken.close()


def test_a_killed_supervisor_takes_its_children_with_it():
    with ServerProcess(*ARGS) as srv:
        # its shared-cache directory, named while it runs: once it is killed, any supervisor that starts (this
        # test's next one, or another test's running beside it) sweeps it
        left = glob.glob(f"/dev/shm/surge-cache-{srv.proc.pid}-*")
        assert left
        roles = children_by_role(srv)
        kids = roles["front"] + roles["engine"]
        assert len(roles["front"]) == 2 and len(roles["engine"]) == 1
        assert httpx.post(srv.url + "/v1/embeddings", json={"input": "before"}, timeout=60).status_code == 200
        srv.proc.send_signal(signal.SIGKILL)  # the supervisor alone, not its process group
        srv.proc.wait(timeout=30)
        _, alive = psutil.wait_procs(kids, timeout=60)
        try:
            assert not alive, [p.cmdline()[:4] for p in alive]
            with pytest.raises(httpx.TransportError):  # nobody answers on the port any more
                httpx.post(srv.url + "/v1/embeddings", json={"input": "after"}, timeout=10)
        finally:  # the orphans of a failed run, which no process group kill reaches once the supervisor is gone
            for p in alive:
                p.kill()
    with ServerProcess(*ARGS) as again:
        assert not any(os.path.exists(d) for d in left)
        assert glob.glob(f"/dev/shm/surge-cache-{again.proc.pid}-*")  # its own stays

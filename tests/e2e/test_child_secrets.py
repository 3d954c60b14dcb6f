"""`surge serve --workers N` keeps its secrets out of its children's command lines.

The supervisor handed each front end and engine process its whole settings as a JSON argument, the API
key included: given as SURGE_API_KEY (so that `ps` would not show it), it still appeared in every
child's /proc/PID/cmdline, which any user of the host can read. Children now take the settings from
their environment (/proc/PID/environ is readable by the same user only), and drop them before they
start processes of their own. Checked on a real `--workers 2` server: the key works, and no process of
the server shows it in its command line.
"""

from __future__ import annotations

import httpx
import psutil
import pytest

from tests.server_process import ServerProcess, children_by_role

pytestmark = pytest.mark.timeout(300)

KEY = "workers-secret-5f0c2a"


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--workers", "2", "--engine", "torch", "--device", "cpu", "--cache-bytes", "0",
                       env={"SURGE_API_KEY": KEY}) as srv:
        yield srv


def test_the_key_is_in_force_and_in_no_command_line(server):
    assert httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, timeout=60).status_code == 401
    r = httpx.post(server.url + "/v1/embeddings", json={"input": "x"}, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 200
    roles = children_by_role(server)
    assert roles["front"] and roles["engine"]
    for p in [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]:
        try:
            cmdline = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        assert KEY not in cmdline, (p.pid, cmdline[:200])

"""What `surge serve` says when it cannot start: exit status 1, the reason in one line, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.server_process import ROOT, free_port


def test_grpc_port_in_use_names_the_flag_and_exits_1():
    """The gRPC port (default 8001: a second server on a machine) taken by another process: the start fails
    naming the address and --grpc-port, exit 1 (was: grpc's RuntimeError traceback, "set GRPC_VERBOSITY=debug",
    and death by SIGTERM)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        grpc_port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "surge.cli.main", "serve", "--port", str(free_port()),
                            "--grpc-port", str(grpc_port), "--threads", "1"],
                           capture_output=True, text=True, timeout=180, cwd=ROOT, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 1, (p.returncode, out[-2000:])
    assert f"127.0.0.1:{grpc_port}" in out and "--grpc-port" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]

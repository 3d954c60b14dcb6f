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


def test_unsupported_model_under_workers_is_one_line_not_a_traceback(tmp_path):
    """Under --workers the engine process builds the model: a configuration error there was printed as its
    traceback before the supervisor's "the engine process exited (1) while starting"."""
    import json
    import shutil

    from surge.models import bundled_model_dir

    d = tmp_path / "qa"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["BertForQuestionAnswering"], "model_type": "bert",
                                               "hidden_size": 32, "vocab_size": 30522}))
    shutil.copy(bundled_model_dir() / "tokenizer.json", d / "tokenizer.json")
    p = subprocess.run([sys.executable, "-m", "surge.cli.main", "serve", str(d), "--workers", "2", "--port",
                        str(free_port()), "--grpc-port", "0", "--threads", "1"],
                       capture_output=True, text=True, timeout=180, cwd=ROOT, check=False)
    out = p.stdout + p.stderr
    assert p.returncode == 1, (p.returncode, out[-2000:])
    assert "BertForQuestionAnswering" in out and "supported" in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]


def test_a_misspelled_generation_variable_fails_the_start_naming_it():
    """SURGE_GENERATION_<FIELD> with no such field (KV_CACHE_TOKEN for KV_CACHE_TOKENS) was silently ignored,
    while the same misspelling in --generation is an error: the start fails, naming the variable and the
    fields, before any model loads."""
    import os

    env = {**os.environ, "SURGE_GENERATION_KV_CACHE_TOKEN": "4096"}
    p = subprocess.run([sys.executable, "-m", "surge.cli.main", "serve", "--port", str(free_port()),
                        "--grpc-port", "0", "--threads", "1"],
                       capture_output=True, text=True, timeout=180, cwd=ROOT, check=False, env=env)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-2000:]
    assert "SURGE_GENERATION_KV_CACHE_TOKEN" in out and "kv_cache_tokens" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]

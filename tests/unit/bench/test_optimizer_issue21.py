"""benchmarks/optimizer_issue21.py's CPU accounting: a process's CPU from /proc, and the two sides' ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import optimizer_issue21 as I  # noqa: E402


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_process_cpu_counts_what_a_process_burns():
    # A child that burns 0.4 s of CPU, then waits to be read: /proc says at least that, and not much more.
    code = ("import time, sys\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
            "print('done', flush=True)\nsys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "done"
        cpu = I._process_cpu_s(proc.pid)
    finally:
        proc.communicate("")
    assert 0.4 <= cpu < 5.0


def test_cpu_ratio_adds_server_and_generator():
    run = {"fp32": {"server_cpu_ms_per_request": 4.0, "generator_cpu_ms_per_request": 0.5},
           "int8": {"server_cpu_ms_per_request": 2.0, "generator_cpu_ms_per_request": 0.5}}
    assert I._cpu_ratio(run) == pytest.approx(4.5 / 2.5)
    assert I._cpu_ratio({"fp32": {"server_cpu_ms_per_request": 4.0}, "int8": {}}) is None

"""Wall-clock timing and machine description shared by the scripts under benchmarks/.

Plain Python only (no aiohttp, no torch): the GPU benchmark scripts import it
on machines that have neither the server stack nor this package's extras.
"""

from __future__ import annotations

import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np


def wall_ms(fn: Callable[[], object], iters: int, warmup: int = 5) -> np.ndarray:
    """Milliseconds of `iters` calls of a synchronous `fn`, after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    times = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return times * 1e3


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def command_line() -> str:
    """This process's command line as one could type it again (`surge ...` for the CLI, however started)."""
    prog = sys.argv[0] if sys.argv else ""
    if prog.replace("\\", "/").endswith(("surge/cli/main.py", "/surge")) or prog == "surge":
        prog = "surge"
    return shlex.join([prog, *sys.argv[1:]])

"""scripts/compile_sm90.py compiles kernels for Hopper on a machine with no GPU (needs a Triton beside the CPU
install; skipped without one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_floor_probe_compiles_for_sm90_with_its_warp_specialized_tma_and_mma():
    pytest.importorskip("triton.experimental.gluon")
    args = ("(lambda w, a, i: (TensorDescriptor.from_tensor(w, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64],"
            " gl.bfloat16)), TensorDescriptor.from_tensor(a, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], "
            "gl.bfloat16)), a, 4096, i, i, 7, i, i))(torch.zeros(4096, 64, dtype=torch.bfloat16), torch.zeros(64, 8192, "
            "dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int32))")
    out = subprocess.run([sys.executable, str(ROOT / "scripts/compile_sm90.py"),
                          "surge.engines.kernels.stream_floor:_stream_floor", args,
                          "dict(SYNC=True, MMA=True, STAGES=24, ASTAGES=2, num_warps=4)",
                          "(132,)"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = out.stdout.strip().splitlines()[-1]
    assert "'wgmma.mma_async': 4" in line and "'cp.async.bulk.tensor': 4" in line, line
    shared = int(line.split("shared ")[1].split()[0])
    assert (24 + 2) * 64 * 64 * 2 <= shared < 227 * 1024  # the ring and the activation stages, within an SM's limit
    ptx = Path("/tmp/_stream_floor.ptx").read_text()
    assert ".target sm_90" in ptx


def test_no_arguments_prints_its_usage():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, str(ROOT / "scripts/compile_sm90.py")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2 and "sm_90" in out.stdout

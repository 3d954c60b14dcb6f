"""Compile a Triton or Gluon kernel for Hopper (sm_90) on a machine with no GPU, to catch compile errors and read its
registers, shared memory and PTX before spending device time. Triton is not a dependency of surge's CPU install:
put a Triton wheel beside it (`pip install --no-deps --target /tmp/tri triton==3.6.0`, the device's version) and run

    PYTHONPATH=/tmp/tri:src python3 scripts/compile_sm90.py MODULE:KERNEL 'ARGS' 'CONSTEXPRS' [GRID]

e.g. `... surge.engines.kernels.stream_floor:_stream_floor`. ARGS is a Python expression evaluated with torch,
gl and TensorDescriptor in scope (CPU tensors stand in for device ones: only dtypes, alignments and shapes reach the
compiler), CONSTEXPRS a dict expression. A stub driver stands for the CUDA one: it names the target and nothing else,
so nothing is launched. Prints shared memory, and the PTX's barrier, MMA and TMA instruction counts; writes the PTX
to /tmp/KERNEL.ptx."""

from __future__ import annotations

import importlib
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime import driver


class _StubDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True

    def map_python_to_cpp_type(self, ty):
        return ty


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    mod, _, name = argv[0].partition(":")
    driver.set_active(_StubDriver())
    kernel = getattr(importlib.import_module(mod), name)
    scope = {"torch": torch, "gl": gl, "TensorDescriptor": TensorDescriptor}
    args = eval(argv[1], scope)  # noqa: S307 (a developer's own command line)
    consts = eval(argv[2], scope)  # noqa: S307
    grid = eval(argv[3]) if len(argv) > 3 else (1,)  # noqa: S307
    k = kernel.warmup(*args, grid=grid, **consts)
    ptx = k.asm["ptx"]
    counts = {i: ptx.count(i) for i in ("bar.sync", "barrier.sync", "wgmma.mma_async", "cp.async.bulk.tensor",
                                        "setmaxnreg")}
    print(f"shared {k.metadata.shared} bytes, warps {k.metadata.num_warps}; PTX {counts}")
    with open(f"/tmp/{name}.ptx", "w") as f:
        f.write(ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Compile engines/kernels/tma_mlp.py for sm_90 on a machine without a GPU and report what ptxas says about it.

Device time is scarce and a Gluon kernel cannot run in Triton's CPU interpreter, so the first questions about a
change (does it compile, how much shared memory, how many registers, does it spill) are asked here: the kernel is
bound against a stub driver whose target is sm_90, compiled to PTX with Triton's own pipeline, then assembled
by the ptxas that ships with Triton (`-v`). Session 15 found its 255-register spill this way.

    python3 benchmarks/gluon_ptxas_check.py [--h 896 --i 4864 --layers 24 --programs 132 --work 7 --pdl]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--h", type=int, default=896)
    ap.add_argument("--i", type=int, default=4864)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--programs", type=int, default=132)
    ap.add_argument("--block-d", type=int, default=64)
    ap.add_argument("--work", type=int, default=7)
    ap.add_argument("--pdl", action="store_true")
    args = ap.parse_args()

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    target = GPUTarget("cuda", 90, 32)

    class _Sm90:  # what Triton asks the driver for while binding arguments; nothing is launched
        def get_current_target(self):
            return target

    driver._active = _Sm90()
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from surge.engines.kernels import tma_mlp as tm

    h, i, n_layers, bd = args.h, args.i, args.layers, args.block_d
    pl = tm.plan(h, i, args.programs, bd)
    bf = torch.bfloat16
    wgu = torch.empty(n_layers * 2 * i, h, dtype=bf)
    wd = torch.empty(n_layers * h, i, dtype=bf)

    def desc(t, rows):
        return TensorDescriptor.from_tensor(t, [rows, tm.CHUNK], gl.NVMMASharedLayout.get_default_for(
            [rows, tm.CHUNK], gl.bfloat16))

    act = torch.empty(tm.BLOCK_M, h, dtype=bf)
    part = torch.empty(4, dtype=torch.float32)
    counter = torch.empty(1, dtype=torch.int32)
    kw = dict(PDL=args.pdl, WORK=args.work, H=h, I=i, BN=pl["BN"], NX=pl["NX"], BD=bd, KD=pl["KD"],
              SPLITS=pl["SPLITS"], BLOCK_H=max(triton.next_power_of_2(h), 128), num_warps=4)
    fn = tm._tma_mlp
    _, _, _, backend, binder = fn.create_binder()
    bound, spec, options = binder(act, act, act, part, act, desc(wgu, pl["BN"]), desc(wgu, 8), desc(wd, bd), counter,
                                  tm.BLOCK_M, 1e-6, 0, n_layers, 0, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, options)
    kernel = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    ptx = kernel.asm["ptx"]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True)
    print(f"plan {pl}")
    print(f"shared memory {kernel.metadata.shared} bytes; PTX: "
          f"{sum('cp.async.bulk.tensor' in line for line in ptx.splitlines())} TMA copies, "
          f"{sum('wgmma.mma_async' in line for line in ptx.splitlines())} warpgroup MMAs")
    report = out.stdout + out.stderr
    for line in report.splitlines():
        if re.search(r"registers|spill|error", line):
            print(line.strip())
    return out.returncode


if __name__ == "__main__":
    raise SystemExit(main())

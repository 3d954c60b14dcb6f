"""Compile the decode GEMM kernels on 8-bit weights (FP8 / INT8) for a Hopper GPU (sm_90) without one.

Triton's compiler and the ptxas its wheel ships, the engine's plans of a benchmarks/generate.py shape (pointer and
TMA, PDL on). Prints each variant's registers, spills and shared memory against the SM's 227 KiB, and fails on a
compile error: a check a session without a device machine can run before the kernels meet a GPU
(tests/gpu/test_weight_quant_cuda.py).

    PYTHONPATH=src python3 benchmarks/q8_compile_check.py [--weights fp8|int8|bf16] [--shape qwen2-0.5b] [--arch 90]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SMEM_LIMIT = 227 * 1024


def _types(kernel, values: dict) -> tuple[dict, dict]:
    """(signature, constexprs) of a kernel: values maps each argument to a type string or a constexpr value."""
    sig, const = {}, {}
    for name in kernel.arg_names:
        v = values[name]
        if isinstance(v, str):
            sig[name] = v
        else:
            sig[name] = "constexpr"
            const[name] = v
    return sig, const


def _resources(cubin: bytes) -> tuple[str, str]:
    """(registers, spill bytes) of a cubin, read by the cuobjdump that Triton's wheel ships."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(cubin)
    try:
        out = subprocess.run([str(tool), "-res-usage", fh.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(fh.name)
    regs = re.search(r"REG:(\d+)", out)
    spill = re.search(r"STACK:(\d+)", out)
    return (regs.group(1) if regs else "?"), (spill.group(1) if spill else "?")


def _compile(kernel, values: dict, arch: int, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, const = _types(kernel, values)
    src = ASTSource(kernel, sig, const)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2-0.5b")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--weights", choices=["fp8", "int8", "bf16"], default="fp8",
                    help="bf16: the same kernels and plans on BF16 weights (what quantization=none compiles)")
    args = ap.parse_args()
    wt = {"fp8": "fp8e4nv", "int8": "i8", "bf16": "bf16"}[args.weights]
    from gpu_decode_gemms import layer_dims

    from surge.engines.kernels import gate_up as gu
    from surge.engines.kernels import splitk_gemm as sk

    dims = layer_dims(args.shape)
    h, i = dims["h"], dims["i"]
    lora = {"la_ptr": "*bf16", "lb_ptr": "*bf16", "slot_ptr": "*i32", "R": "i32", "W": "i32", "stride_la": "i32",
            "stride_lb": "i32", "LORA": False, "BLOCK_R": 16}
    rows, failed = [], 0
    for name, (n, k) in {"qkv": (dims["qkv"], h), "o": (h, h), "down": (h, i)}.items():
        plan = sk.q8_plan_for(n, k) if args.weights != "bf16" else sk.plan_for(n, k) or sk.default_plan(n, k)
        ks = plan.k_split(k)
        common = {"ws_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "stride_wn": "i32", "scale_ptr": "*fp32",
                  "W_SCALE": args.weights != "bf16", "K_SPLIT": ks, "SWAP": plan.swap, "BLOCK_M": sk.BLOCK_M,
                  "BLOCK_N": plan.block_n,
                  "BLOCK_K": plan.block_k, "PDL": True, "LINES": 1 << max(0, (ks - 1).bit_length() - 7), **lora}
        variants = [("pointer", sk._partials, {**common, "a_ptr": "*bf16", "w_ptr": f"*{wt}", "stride_am": "i32",
                                               "EVEN_K": k % ks == 0})]
        variants.append(("tma", sk._partials_tma, {
            **common, "a_desc": f"tensordesc<bf16[{sk.BLOCK_M}, {plan.block_k}]>",
            "w_desc": f"tensordesc<{wt}[{plan.block_n}, {plan.block_k}]>", "w_ptr": f"*{wt}",
            "la_desc": f"tensordesc<{wt}[{plan.block_n}, {plan.block_k}]>", "LA_TMA": False}))
        for form, kernel, values in variants:
            rows.append((f"{name} {n}x{k} {form}", plan, kernel, values, plan.num_warps, plan.num_stages))
    plan = gu.q8_plan_for(i, h) if args.weights != "bf16" else gu.plan_for(i, h) or gu.default_plan(i, h)
    common = {"out_ptr": "*bf16", "M": "i32", "I": "i32", "K": "i32", "stride_wn": "i32", "stride_om": "i32",
              "scale_ptr": "*fp32", "W_SCALE": args.weights != "bf16", "SWAP": plan.swap, "BLOCK_M": gu.BLOCK_M,
              "BLOCK_N": plan.block_n,
              "BLOCK_K": plan.block_k, "PDL": True, "LINES": 1 << max(0, (h - 1).bit_length() - 7), **lora}
    rows.append((f"gate_up {2 * i}x{h} pointer", plan, gu._gate_up,
                 {**common, "a_ptr": "*bf16", "w_ptr": f"*{wt}", "stride_am": "i32", "EVEN_K": h % plan.block_k == 0},
                 plan.num_warps, plan.num_stages))
    rows.append((f"gate_up {2 * i}x{h} tma", plan, gu._gate_up_tma,
                 {**common, "a_desc": f"tensordesc<bf16[{gu.BLOCK_M}, {plan.block_k}]>",
                  "w_desc": f"tensordesc<{wt}[{plan.block_n}, {plan.block_k}]>", "w_ptr": f"*{wt}",
                  "la_desc": f"tensordesc<{wt}[{plan.block_n}, {plan.block_k}]>", "LA_TMA": False},
                 plan.num_warps, plan.num_stages))
    print(f"| kernel ({args.shape}, {args.weights} weights, sm_{args.arch}) | plan | the engine's form | registers | "
          "stack bytes | shared KiB | fits |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- |")
    for label, plan, kernel, values, warps, stages in rows:
        try:
            c = _compile(kernel, values, args.arch, warps, stages)
        except Exception as exc:  # a compile error: the point of the check
            failed += 1
            print(f"| {label} | {plan} | | COMPILE ERROR: {type(exc).__name__}: {str(exc)[:300]} | | | no |")
            continue
        md = c.metadata
        regs, spills = _resources(c.asm["cubin"])
        runs = "yes" if label.endswith("tma") == plan.tma else ""
        print(f"| {label} | {plan} | {runs} | {regs} | {spills} | {md.shared / 1024:.1f} | "
              f"{'yes' if md.shared <= SMEM_LIMIT else 'NO'} |")
        failed += md.shared > SMEM_LIMIT
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

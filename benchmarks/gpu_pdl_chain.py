"""Experiment: can a chain of skinny GEMMs beat cuBLAS at batch 1 by overlapping weight reads?

At M = 32 every GEMM of a BERT-base layer is bound by how long its CTAs wait for
their weight tiles (docs/gpu_notes.md). With programmatic dependent launch (PDL)
a kernel can start while its predecessor runs, fetch its *weights* (which do not
depend on the predecessor) and only then wait (griddepcontrol.wait) for the
activations. This script times 12 layers' worth of the four GEMMs (QKV + bias,
out-projection + residual, FFN-in + bias + GeLU, FFN-out + residual; M = 32,
BERT-base shapes, fp16) captured in one CUDA graph:

  cublas    torch.addmm / _addmm_activation / addmm_ (what the engine runs now)
  triton    a skinny Triton GEMM, plain launches
  pdl       the same kernel launched with PDL, waiting before any load
  pdl+l2    PDL; the CTA's weight slice prefetched into L2 before the wait
  pdl+reg   PDL; the CTA's weight slice loaded into registers before the wait (K <= 1024)

Outputs of every Triton variant must equal the plain launch bit for bit (a race
would show there); the cuBLAS chain runs the same shapes and kernel count (bias
and residual placed as the engine places them), so only its time is compared. Prints a table; --out writes JSON.

    PYTHONPATH=src python3 benchmarks/gpu_pdl_chain.py --out pdl_chain.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_encoder import cuda_time  # noqa: E402

H, I, LAYERS, M = 768, 3072, 12, 32


@triton.jit
def _skinny(a_ptr, w_ptr, bias_ptr, res_ptr, c_ptr, M, N, stride_am,
            K: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            GELU: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr, PRE: tl.constexpr,
            LINES: tl.constexpr, N_LINES: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < M
    if PRE == 2:  # whole K x BLOCK_N weight slice into registers, before the wait
        kk = tl.arange(0, KP)
        w_all = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + kk[:, None],
                        mask=(kk[:, None] < K) & nmask[None, :], other=0.0)
    if PRE == 1:  # the slice is BLOCK_N contiguous rows of W: prefetch its lines into L2
        lines = tl.minimum(tl.arange(0, LINES), N_LINES - 1)
        base = (w_ptr + (pid * BLOCK_N).to(tl.int64) * K).to(tl.pointer_type(tl.int8))
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [base + lines.to(tl.int64) * 128], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if PRE == 2:
        kk = tl.arange(0, KP)
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :], mask=mmask[:, None] & (kk[None, :] < K),
                    other=0.0)
        acc = tl.dot(a, w_all)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs_k
            a = tl.load(a_ptr + offs_m[:, None] * stride_am + kk[None, :], mask=mmask[:, None] & (kk[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * K + kk[:, None],
                        mask=(kk[:, None] < K) & nmask[None, :], other=0.0)
            acc = tl.dot(a, w, acc)
    acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if GELU:
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    cmask = mmask[:, None] & nmask[None, :]
    cp = offs_m[:, None] * N + offs_n[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + cp, mask=cmask, other=0.0).to(tl.float32)
    tl.store(c_ptr + cp, acc.to(c_ptr.dtype.element_ty), mask=cmask)


def skinny(a, w, bias, out, res=None, gelu=False, pdl=False, pre=0, block_n=16):
    m, k = a.shape
    n = w.shape[0]
    pre = pre if (pre != 2 or k <= 1024) else 1
    warps = 8 if k > 1024 else 4
    _skinny[(triton.cdiv(n, block_n),)](
        a, w, bias, res if res is not None else out, out, m, n, a.stride(0), K=k, KP=triton.next_power_of_2(k),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=128, GELU=gelu,
        HAS_RES=res is not None, PDL=pdl, PRE=pre, num_warps=warps, num_stages=3,
        LINES=triton.next_power_of_2(triton.cdiv(block_n * k * 2, 128)), N_LINES=triton.cdiv(block_n * k * 2, 128),
        **({"launch_pdl": True} if pdl else {}))
    return out


def make_layers(g):
    def r(*s, scale):
        return (torch.randn(*s, generator=g) * scale).to("cuda", torch.float16)
    return [dict(wqkv=r(3 * H, H, scale=H ** -0.5), bqkv=r(3 * H, scale=0.1), wo=r(H, H, scale=H ** -0.5),
                 bo=r(H, scale=0.1), w1=r(I, H, scale=H ** -0.5), b1=r(I, scale=0.1), w2=r(H, I, scale=I ** -0.5),
                 b2=r(H, scale=0.1)) for _ in range(LAYERS)]


def chain(variant, layers, x, qkv, h, f):
    """x [M, H] -> 12 layers of the four GEMMs, in place on x and h (no attention, no LN: GEMMs only)."""
    for lw in layers:
        if variant == "cublas":
            # as the engine runs them: bias in the QKV epilogue, residual as C (its LN adds the bias)
            torch.addmm(lw["bqkv"], x, lw["wqkv"].t(), out=qkv)
            x.addmm_(qkv[:, :H], lw["wo"].t())
            torch._addmm_activation(lw["b1"], x, lw["w1"].t(), use_gelu=True, out=f)
            x.addmm_(f, lw["w2"].t())
        else:
            pdl = variant.startswith("pdl")
            pre = {"pdl+l2": 1, "pdl+reg": 2}.get(variant, 0)
            skinny(x, lw["wqkv"], lw["bqkv"], qkv, pdl=pdl, pre=pre)
            skinny(qkv[:, :H], lw["wo"], lw["bo"], h, res=x, pdl=pdl, pre=pre)
            skinny(h, lw["w1"], lw["b1"], f, gelu=True, pdl=pdl, pre=pre)
            skinny(f, lw["w2"], lw["b2"], x, res=h, pdl=pdl, pre=pre)
    return x


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="pdl_chain.json")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    layers = make_layers(g)
    x0 = torch.randn(M, H, generator=g).to("cuda", torch.float16) * 0.1
    results, outs = [], {}
    for variant in ("cublas", "triton", "pdl", "pdl+l2", "pdl+reg"):
        x = x0.clone()
        qkv = torch.empty(M, 3 * H, device="cuda", dtype=torch.float16)
        h = torch.empty(M, H, device="cuda", dtype=torch.float16)
        f = torch.empty(M, I, device="cuda", dtype=torch.float16)
        s = torch.cuda.Stream()
        try:
            with torch.cuda.stream(s):
                chain(variant, layers, x, qkv, h, f)  # compile
            s.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                chain(variant, layers, x, qkv, h, f)
            x.copy_(x0)
            graph.replay()
            torch.cuda.synchronize()
            outs[variant] = x.clone()
            ms = cuda_time(lambda: (x.copy_(x0), graph.replay()), iters=300, warmup=30)
            row = {"variant": variant, "ms": ms, "us_per_gemm": ms * 1e3 / (4 * LAYERS)}
            if variant != "cublas":
                row["max_abs_vs_triton"] = float((outs[variant].float() - outs["triton"].float()).abs().max())
        except Exception as exc:  # noqa: BLE001 - an experiment: report and go on
            row = {"variant": variant, "error": f"{type(exc).__name__}: {exc}"[:400]}
        results.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    base = next(r["ms"] for r in results if r["variant"] == "cublas")
    print("\n| variant | 48 GEMMs ms | us / GEMM | vs cuBLAS | max abs vs plain Triton |\n|---|---|---|---|---|")
    for r in results:
        if "ms" in r:
            print(f"| {r['variant']} | {r['ms']:.3f} | {r['us_per_gemm']:.2f} | {base / r['ms']:.2f}x | "
                  f"{r.get('max_abs_vs_triton', 0):.3g} |")
        else:
            print(f"| {r['variant']} | error: {r['error'][:80]} | | | |")


if __name__ == "__main__":
    main()

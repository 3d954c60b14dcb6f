"""The decode step's layer GEMMs with their weights read by TMA (Triton tensor descriptors), measured
against the pointer-load kernels the engine runs (issue 18, session 18).

Why: session 15 measured TMA copies streaming weights at 4.0-4.1 TB/s from a ring of a few tiles an SM,
twice the ~2 TB/s of the engine's Triton kernels (pointer loads, cp.async pipelining); its persistent
kernel lost that to grid barriers. Here the same TMA loads go into the engine's own kernel shapes,
one launch a GEMM, no barriers: kernels/gate_up.py's SiLU(gate) * up and kernels/splitk_gemm.py's
split-K partials, with tensor descriptors for both operands (out-of-bounds rows and columns are
zero-filled by the copy engine, so no masks).

For each GEMM of Qwen2-0.5B at M = 64 (BF16): every candidate plan is checked against the engine's
kernel (max abs difference of the outputs, and whether they are equal bit for bit), then timed as 24
layers' distinct weights in one CUDA graph (median of 7 x 20 replays); the MLP half of a layer
(add_rmsnorm -> gate/up -> split-K down -> add_rmsnorm) is timed with the engine's kernels and with the
best TMA ones, with and without PDL. Prints tables; --json writes everything.

    PYTHONPATH=src python3 benchmarks/gpu_tma_gemm.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode_gemms import timed  # noqa: E402

from surge.engines.kernels.pdl import launch_kw, prefetch_l2, wait_then_release  # noqa: E402

H, I, QKV, LAYERS, M = 896, 4864, 1152, 24, 64


@triton.jit(do_not_specialize=["M"])
def _gate_up_tma(a_desc, w_desc, w_ptr, out_ptr, M, I, K, stride_wn, stride_om, SWAP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                 LINES: tl.constexpr, WS: tl.constexpr, PREFETCH: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    if PDL and PREFETCH:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        line = tl.minimum(tl.arange(0, LINES).to(tl.int64) * 128, K.to(tl.int64) * 2 - 1)
        rows = tl.minimum(offs_n, I - 1).to(tl.int64)
        base = w_ptr.to(tl.pointer_type(tl.int8)) + rows[:, None] * stride_wn * 2 + line[None, :]
        prefetch_l2(base)
        prefetch_l2(base + I.to(tl.int64) * stride_wn * 2)
    wait_then_release(PDL)
    if SWAP:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.range(0, tl.cdiv(K, BLOCK_K), warp_specialize=WS):
        k = i * BLOCK_K
        a = a_desc.load([m0, k])
        g = w_desc.load([n0, k])
        u = w_desc.load([I + n0, k])
        if SWAP:
            acc_g = tl.dot(g, tl.trans(a), acc_g)
            acc_u = tl.dot(u, tl.trans(a), acc_u)
        else:
            acc_g = tl.dot(a, tl.trans(g), acc_g)
            acc_u = tl.dot(a, tl.trans(u), acc_u)
    dt = out_ptr.dtype.element_ty
    gf = acc_g.to(dt).to(tl.float32)
    up = acc_u.to(dt)
    y = (gf / (1.0 + tl.exp(-gf))).to(dt) * up
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < I
    if SWAP:
        tl.store(out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None], y,
                 mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], y,
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _partials_tma(a_desc, w_desc, w_ptr, ws_ptr, M, N, K, stride_wn, K_SPLIT: tl.constexpr, SWAP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                  LINES: tl.constexpr, WS: tl.constexpr, PREFETCH: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    k0 = pid_s * K_SPLIT
    if PDL and PREFETCH:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        row_bytes = (tl.minimum(K - k0, K_SPLIT) * 2).to(tl.int64)
        line = tl.minimum(tl.arange(0, LINES).to(tl.int64) * 128, row_bytes - 1)
        rows = tl.minimum(offs_n, N - 1).to(tl.int64)
        base = (w_ptr + k0).to(tl.pointer_type(tl.int8))
        prefetch_l2(base + rows[:, None] * stride_wn * 2 + line[None, :])
    wait_then_release(PDL)
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in tl.range(0, K_SPLIT // BLOCK_K, warp_specialize=WS):
        a = a_desc.load([m0, k0 + i * BLOCK_K])
        w = w_desc.load([n0, k0 + i * BLOCK_K])
        if SWAP:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    ws = ws_ptr + pid_s.to(tl.int64) * M * N
    if SWAP:
        tl.store(ws + offs_m[None, :].to(tl.int64) * N + offs_n[:, None], acc, mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(ws + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


class Descs:
    """Host tensor descriptors, made once per (tensor, block) as the engine would cache them."""

    def __init__(self):
        self.cache = {}

    def __call__(self, t: torch.Tensor, block):
        from triton.tools.tensor_descriptor import TensorDescriptor

        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), tuple(block))
        if key not in self.cache:
            self.cache[key] = TensorDescriptor.from_tensor(t, list(block))
        return self.cache[key]


DESCS = Descs()


def gate_up_tma(x, w, plan, pdl=False, out=None, prefetch=True):
    bn, bk, nw, st, sw, *rest = plan
    ws = bool(rest and rest[0])
    m, k = x.shape
    i = w.shape[0] // 2
    out = torch.empty((m, i), device=x.device, dtype=x.dtype) if out is None else out
    grid = (triton.cdiv(i, bn), triton.cdiv(m, 64))
    _gate_up_tma[grid](DESCS(x, (64, bk)), DESCS(w, (bn, bk)), w, out, m, i, k, w.stride(0), out.stride(0),
                       SWAP=sw, BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
                       LINES=triton.next_power_of_2(triton.cdiv(k * 2, 128)), WS=ws, PREFETCH=prefetch,
                       num_warps=nw, num_stages=st, **launch_kw(pdl))
    return out


def partials_tma(a, w, plan, pdl=False, out=None, prefetch=True):
    bn, bk, splits, nw, st, sw, *rest = plan
    ws = bool(rest and rest[0])
    m, k = a.shape
    n = w.shape[0]
    ks = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    s = triton.cdiv(k, ks)
    out = torch.empty((s, m, n), device=a.device, dtype=torch.float32) if out is None else out
    grid = (triton.cdiv(n, bn), s, triton.cdiv(m, 64))
    _partials_tma[grid](DESCS(a, (64, bk)), DESCS(w, (bn, bk)), w, out, m, n, k, w.stride(0), K_SPLIT=ks, SWAP=sw,
                        BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk, PDL=pdl,
                        LINES=triton.next_power_of_2(triton.cdiv(ks * 2, 128)), WS=ws, PREFETCH=prefetch,
                        num_warps=nw, num_stages=st, **launch_kw(pdl))
    return out


SPLITS = {"down": (4, 7), "qkv": (7, 4), "o": (4, 2)}  # the engine's count first (its readers' measured pairs)
SHAPES = {"down": (H, I), "qkv": (QKV, H), "o": (H, H)}


WARP_SPECIALIZE = [False]  # --warp-specialize adds True (call 2: illegal memory accesses on Triton 3.6)


def gate_up_candidates(quick=False):
    out = [(bn, bk, nw, st, sw, ws) for ws in WARP_SPECIALIZE for sw in (False, True) for bn in (16, 32, 64, 128)
           for bk in (64, 128) for nw in (4, 8) for st in (2, 3, 4, 6)]
    return out[::4] if quick else out


def splitk_candidates(name, quick=False):
    out = [(bn, bk, s, nw, st, sw, ws) for ws in WARP_SPECIALIZE for sw in (False, True) for bn in (32, 64, 128)
           for bk in (64, 128, 256) for s in SPLITS[name] for nw in ((4, 8) if ws else (4,)) for st in (2, 3, 4, 6)
           if bn * bk * st <= 64 * 256 * 3]
    return out[::5] if quick else out


def _compile(jobs):
    """Compile (and so cache on disk) each job's kernel in a worker process; the refused ones come back."""
    bad = []
    for name, p in jobs:
        try:
            if name == "gate_up":
                gate_up_tma(torch.randn(M, H, device="cuda", dtype=torch.bfloat16),
                            torch.randn(2 * I, H, device="cuda", dtype=torch.bfloat16), p)
            else:
                n, k = SHAPES[name]
                partials_tma(torch.randn(M, k, device="cuda", dtype=torch.bfloat16),
                             torch.randn(n, k, device="cuda", dtype=torch.bfloat16), p)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported by the main process
            bad.append((name, p, f"{type(exc).__name__}: {str(exc)[:160]}"))
    return bad


def precompile(quick, workers):
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    jobs = [("gate_up", p) for p in gate_up_candidates(quick)]
    jobs += [(name, p) for name in SHAPES for p in splitk_candidates(name, quick)]
    step = -(-len(jobs) // workers)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as ex:
        for bad in ex.map(_compile, [jobs[i:i + step] for i in range(0, len(jobs), step)]):
            for name, p, why in bad:
                print(f"  refused {name} {p}: {why}", flush=True)
    print(f"{len(jobs)} kernels compiled in {time.perf_counter() - t0:.0f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--warp-specialize", action="store_true",
                    help="also warp-specialized loops (tl.range(warp_specialize=True)); session 18's call 2 found "
                         "illegal memory accesses with them, which poison the compiling workers' contexts")
    args = ap.parse_args()
    if args.warp_specialize:
        WARP_SPECIALIZE.append(True)
    if args.workers > 1:
        precompile(args.quick, args.workers)
    from surge.engines.kernels import pdl as pdl_mod
    from surge.engines.kernels.decoder_fused import add_rmsnorm
    from surge.engines.kernels.gate_up import gate_up_silu
    from surge.engines.kernels.gate_up import plan_for as gu_plan_for
    from surge.engines.kernels.splitk_gemm import partials
    from surge.engines.kernels.splitk_gemm import plan_for as sk_plan_for

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(M, H, device=dev, dtype=bf)
    xi = torch.randn(M, I, device=dev, dtype=bf)
    w_gu = [torch.randn(2 * I, H, device=dev, dtype=bf) * 0.03 for _ in range(LAYERS)]
    w_dn = [torch.randn(H, I, device=dev, dtype=bf) * 0.02 for _ in range(LAYERS)]
    w_qkv = [torch.randn(QKV, H, device=dev, dtype=bf) * 0.03 for _ in range(LAYERS)]
    w_o = [torch.randn(H, H, device=dev, dtype=bf) * 0.03 for _ in range(LAYERS)]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "gemms": {}}

    # ---- gate/up ---------------------------------------------------------------------------
    gu = gu_plan_for(I, H)
    ref = gate_up_silu(x, w_gu[0], gu)
    t_ref = timed(lambda: [gate_up_silu(x, w, gu) for w in w_gu]) / LAYERS
    rows = []
    cands = gate_up_candidates(args.quick)
    for p in cands:
        try:
            out = gate_up_tma(x, w_gu[0], p)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a plan the compiler refuses is reported and skipped
            rows.append({"plan": p, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        diff = (out.float() - ref.float()).abs().max().item()
        t = timed(lambda p=p: [gate_up_tma(x, w, p) for w in w_gu]) / LAYERS
        rows.append({"plan": p, "us": t, "max_abs_diff": diff, "bit_equal": bool(torch.equal(out, ref))})
    ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    print(f"gate/up [{2 * I} x {H}], M = {M}, 24 layers' weights, us a layer: engine kernel {gu} {t_ref:.2f}; "
          f"TMA best 8 of {len(ok)} ({sum('error' in r for r in rows)} refused):", flush=True)
    for r in ok[:8]:
        print(f"  {r['us']:.2f}  {r['plan']}  max|diff| {r['max_abs_diff']:.3g}  bit-equal {r['bit_equal']}")
    report["gemms"]["gate_up"] = {"engine_plan": str(gu), "engine_us": t_ref, "tma": rows}
    best_gu = ok[0]["plan"] if ok else None
    top_gu = [r["plan"] for r in ok[:3]]

    # ---- split-K GEMMs -------------------------------------------------------------------------
    best_sk = {}
    for name, ws, a in (("down", w_dn, xi), ("qkv", w_qkv, x), ("o", w_o, x)):
        n, k = SHAPES[name]
        plan = sk_plan_for(n, k)
        ref = partials(a, ws[0], plan)
        t_ref = timed(lambda: [partials(a, w, plan) for w in ws]) / LAYERS
        rows = []
        for p in splitk_candidates(name, args.quick):
            try:
                out = partials_tma(a, ws[0], p)
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001
                rows.append({"plan": p, "error": f"{type(exc).__name__}: {str(exc)[:160]}"})
                continue
            full = out.sum(0)
            diff = (full - ref.sum(0)).abs().max().item()
            same_shape = out.shape == ref.shape
            t = timed(lambda p=p: [partials_tma(a, w, p) for w in ws]) / LAYERS
            rows.append({"plan": p, "us": t, "max_abs_diff_of_sums": diff,
                         "bit_equal": bool(same_shape and torch.equal(out, ref)), "splits_run": out.shape[0]})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        print(f"\n{name} [{n} x {k}] partials, us a layer: engine {plan} {t_ref:.2f}; TMA best 8 of {len(ok)}:",
              flush=True)
        for r in ok[:8]:
            print(f"  {r['us']:.2f}  {r['plan']} ({r['splits_run']} splits)  max|diff| of sums "
                  f"{r['max_abs_diff_of_sums']:.3g}  bit-equal {r['bit_equal']}")
        report["gemms"][name] = {"engine_plan": str(plan), "engine_us": t_ref, "tma": rows}
        # the reader sums `plan.num_splits` partials: only plans with the engine's split count drop in
        # the pair with its reader decides (more splits, more for the reader to sum): the best of each count
        best_sk[name] = [next(r["plan"] for r in ok if r["plan"][2] == c) for c in SPLITS[name]
                         if any(r["plan"][2] == c for r in ok)]

    # ---- the MLP half of a layer, as the step chains it -------------------------------------------
    pdl_ok = pdl_mod.supported()
    norms = [1 + torch.rand(H, device=dev, dtype=bf) for _ in range(LAYERS)]
    resid = torch.randn(M, H, device=dev, dtype=bf)
    dn = sk_plan_for(H, I)

    # Tensors made inside the captured graph keep their addresses on every replay, so the descriptors
    # made for them while capturing stay valid (DESCS keys them by address, shape and strides).
    def chain(gu_plan, down_plan, pdl, prefetch=True):
        def run():
            h = add_rmsnorm(resid, None, norms[0], 1e-6, pdl=pdl)
            for li in range(LAYERS):
                if down_plan is not None:
                    act = gate_up_tma(h, w_gu[li], gu_plan, pdl=pdl, prefetch=prefetch)
                    part = partials_tma(act, w_dn[li], down_plan, pdl=pdl, prefetch=prefetch)
                else:
                    part = partials(gate_up_silu(h, w_gu[li], gu, pdl=pdl), w_dn[li], dn, pdl=pdl)
                h = add_rmsnorm(resid, part, norms[li], 1e-6, pdl=pdl)
        return run

    report["chain"] = []
    if best_gu is not None:
        print("\nthe MLP half of a layer (add_rmsnorm -> gate/up -> split-K down -> add_rmsnorm), us a layer:")
        variants = [(None, None, pdl, True) for pdl in (False, True)]
        for gu_plan in top_gu:
            for down_plan in best_sk["down"]:
                variants += [(gu_plan, down_plan, False, True), (gu_plan, down_plan, True, True),
                             (gu_plan, down_plan, True, False)]
        for gu_plan, down_plan, pdl, prefetch in variants:
            if pdl and not pdl_ok:
                continue
            t = timed(chain(gu_plan, down_plan, pdl, prefetch)) / LAYERS
            report["chain"].append({"gate_up": gu_plan, "down": down_plan, "pdl": pdl, "l2_prefetch": prefetch,
                                    "us": t})
            what = "engine kernels" if down_plan is None else f"TMA gate/up {gu_plan}, down {down_plan}"
            print(f"  {t:.2f}  {what}, pdl={pdl}{'' if prefetch else ', no L2 prefetch'}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

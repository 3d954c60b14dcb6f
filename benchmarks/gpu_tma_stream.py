"""How fast can a persistent decode kernel stream a layer's MLP weights through shared memory? (issue 18)

Session 14 measured a persistent MLP kernel (engines/kernels/persistent_mlp.py) whose phases streamed the
weights at ~2 TB/s, latency-bound like the separate kernels: each program had only a few tiles in flight
(Triton's software pipeline, 3 stages), and the weights of the next phase could not be asked for before a
grid barrier except into L2 (which slowed it) or registers (slower still). This script measures the design
named next: TMA bulk copies of whole weight tiles into a ring of shared-memory buffers (Gluon, Hopper), the
ring running straight across phase boundaries. Weights never depend on the previous phase, so a program
can keep D tiles in flight through a grid barrier; only the activations wait for it.

The kernel is a measuring device, not an engine kernel: 24 layers of Qwen2-0.5B's MLP weights (gate/up
[9728, 896], down [896, 4864], BF16) cut into [128, 64] tiles, dealt round robin over P persistent programs
(1064 gate/up and 532 down tiles a layer), each tile consumed by one warpgroup MMA against a [64, 64]
activation tile (fixed in shared memory, or copied from a [64, 4864] activation by TMA with the weight
tile: XLOAD), a grid barrier after each phase (SYNC). It answers: at what rate do the weights stream,
with and without barriers and MMAs, for ring depths D and grid sizes P, against cuBLAS's two GEMMs a layer
at M = 64 and the separate-kernel MLP half session 14 measured (16.1-16.2 us a layer with PDL).

    PYTHONPATH=src python3 benchmarks/gpu_tma_stream.py [--json out.json]

The MMA results are checked (float64, 2 layers) so that nothing is optimized away or mis-addressed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_decode_gemms import timed  # noqa: E402  (one CUDA graph, median of 7 timings of 20 replays)
from surge.engines.kernels.tma_mlp import _spin_until  # noqa: E402  (the grid barrier's polling thread)

LAYERS, HID, INTER, BATCH = 24, 896, 4864, 64
BR, BK = 128, 64  # a weight tile: 128 rows x 64 columns, 16 KB (128-byte rows: the 128-byte swizzle)


@gluon.jit
def _tile(j, p, P, C_GU, N_L, T_GU_K: gl.constexpr, T_D_K: gl.constexpr, ROWS_GU: gl.constexpr,
          ROWS_D: gl.constexpr):
    """Program p's j-th tile: (down?, row, column) in the stacked [LAYERS * rows, K] weights."""
    layer = j // N_L
    r = j - layer * N_L
    down = r >= C_GU
    t = p + gl.where(down, r - C_GU, r) * P
    kt = gl.where(down, T_D_K, T_GU_K)
    row = layer * gl.where(down, ROWS_D, ROWS_GU) + (t // kt) * 128
    col = (t % kt) * 64
    return down, row, col


@gluon.jit
def _issue(j, p, P, C_GU, N_L, gu_desc, d_desc, x_desc, w_smem, x_smem, bars, D: gl.constexpr,
           XLOAD: gl.constexpr, T_GU_K: gl.constexpr, T_D_K: gl.constexpr, ROWS_GU: gl.constexpr,
           ROWS_D: gl.constexpr):
    s = j % D
    down, row, col = _tile(j, p, P, C_GU, N_L, T_GU_K, T_D_K, ROWS_GU, ROWS_D)
    bar = bars.index(s)
    if XLOAD:
        mbarrier.expect(bar, gu_desc.block_type.nbytes + x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [0, col], bar, x_smem.index(s))
    else:
        mbarrier.expect(bar, gu_desc.block_type.nbytes)
    if down:
        tma.async_copy_global_to_shared(d_desc, [row, col], bar, w_smem.index(s))
    else:
        tma.async_copy_global_to_shared(gu_desc, [row, col], bar, w_smem.index(s))


@gluon.jit
def _stream(gu_desc, d_desc, x_desc, x0_desc, out_ptr, bar_ptr, P, n_layers,
            D: gl.constexpr, SYNC: gl.constexpr, COMPUTE: gl.constexpr, XLOAD: gl.constexpr,
            T_GU: gl.constexpr, T_D: gl.constexpr, T_GU_K: gl.constexpr, T_D_K: gl.constexpr,
            ROWS_GU: gl.constexpr, ROWS_D: gl.constexpr, num_warps: gl.constexpr):
    p = gl.program_id(0)
    c_gu = (T_GU - p + P - 1) // P  # this program's tiles of a layer's gate/up phase, then of its down phase
    c_d = (T_D - p + P - 1) // P
    n_l = c_gu + c_d
    total = n_layers * n_l

    dtype: gl.constexpr = gu_desc.dtype
    w_smem = gl.allocate_shared_memory(dtype, [D, 128, 64], gu_desc.layout)
    if XLOAD:
        x_smem = gl.allocate_shared_memory(dtype, [D, 64, 64], x_desc.layout)
    else:
        x_smem = gl.allocate_shared_memory(dtype, [1, 64, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [D + 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(D + 1):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    if not XLOAD:  # one activation tile for every MMA
        mbarrier.expect(bars.index(D), x0_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x0_desc, [0, 0], bars.index(D), x_smem.index(0))
        mbarrier.wait(bars.index(D), 0)

    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, 64, 16])
    acc = gl.zeros([128, 64], gl.float32, acc_layout)

    for j in gl.static_range(D - 1):  # the ring's first D - 1 tiles
        if j < total:
            _issue(j, p, P, c_gu, n_l, gu_desc, d_desc, x_desc, w_smem, x_smem, bars, D, XLOAD,
                   T_GU_K, T_D_K, ROWS_GU, ROWS_D)
    phase_no = 0
    for j in range(total):
        nxt = j + D - 1  # into the slot consumed at j - 1 (the MMA is synchronous: it is free)
        if nxt < total:
            _issue(nxt, p, P, c_gu, n_l, gu_desc, d_desc, x_desc, w_smem, x_smem, bars, D, XLOAD,
                   T_GU_K, T_D_K, ROWS_GU, ROWS_D)
        s = j % D
        mbarrier.wait(bars.index(s), (j // D) & 1)
        if COMPUTE:
            if XLOAD:
                acc = warpgroup_mma(w_smem.index(s), x_smem.index(s).permute((1, 0)), acc)
            else:
                acc = warpgroup_mma(w_smem.index(s), x_smem.index(0).permute((1, 0)), acc)
        if SYNC:
            r = j % n_l
            if (r == c_gu - 1) | (r == n_l - 1):  # this program's last tile of a phase: a grid barrier
                phase_no += 1
                gl.thread_barrier()
                gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
                _spin_until(bar_ptr, phase_no * P)

    for i in gl.static_range(D + 1):
        mbarrier.invalidate(bars.index(i))
    if COMPUTE:
        rows = gl.arange(0, 128, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, acc_layout))
        offs = p * (128 * 64) + rows[:, None] * 64 + cols[None, :]
        gl.store(out_ptr + offs, acc)


def _descs(w_gu, w_d, x):
    lay = gl.NVMMASharedLayout.get_default_for([BR, BK], gl.bfloat16)
    xl = gl.NVMMASharedLayout.get_default_for([64, BK], gl.bfloat16)
    return (TensorDescriptor.from_tensor(w_gu, [BR, BK], lay), TensorDescriptor.from_tensor(w_d, [BR, BK], lay),
            TensorDescriptor.from_tensor(x, [64, BK], xl), TensorDescriptor.from_tensor(x, [64, BK], xl))


def launch(w_gu, w_d, x, out, bar, P, n_layers, D, sync, compute, xload, descs=None):
    gu_desc, d_desc, x_desc, x0_desc = descs or _descs(w_gu, w_d, x)
    t_gu = (2 * INTER // BR) * (HID // BK)
    t_d = (HID // BR) * (INTER // BK)
    _stream[(P,)](gu_desc, d_desc, x_desc, x0_desc, out, bar, P, n_layers, D=D, SYNC=sync, COMPUTE=compute,
                  XLOAD=xload, T_GU=t_gu, T_D=t_d, T_GU_K=HID // BK, T_D_K=INTER // BK, ROWS_GU=2 * INTER,
                  ROWS_D=HID, num_warps=4)


def reference(w_gu, w_d, x, P, n_layers, xload):
    """Each program's sum of W_tile @ X_tile^T over its tiles, in float64 (the kernel's dealing)."""
    t_gu_k, t_d_k = HID // BK, INTER // BK
    t_gu, t_d = (2 * INTER // BR) * t_gu_k, (HID // BR) * t_d_k
    out = torch.zeros(P, BR, 64, dtype=torch.float64, device=x.device)
    x64 = x.double()
    for layer in range(n_layers):
        for down, t_all, kt, rows, w in ((False, t_gu, t_gu_k, 2 * INTER, w_gu), (True, t_d, t_d_k, HID, w_d)):
            for t in range(t_all):
                p = t % P
                r0 = layer * rows + (t // kt) * BR
                c0 = (t % kt) * BK
                wt = w[r0:r0 + BR, c0:c0 + BK].double()
                xt = x64[:, c0:c0 + BK] if xload else x64[:, :BK]
                out[p] += wt @ xt.T
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    dev, bf = "cuda", torch.bfloat16
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w_gu = torch.randn(LAYERS * 2 * INTER, HID, device=dev, dtype=bf) * 0.03
    w_d = torch.randn(LAYERS * HID, INTER, device=dev, dtype=bf) * 0.02
    x = torch.randn(BATCH, INTER, device=dev, dtype=bf)
    layer_bytes = (2 * INTER * HID + HID * INTER) * 2
    descs = _descs(w_gu, w_d, x)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "sms": sms, "layer_mb": layer_bytes / 1e6, "rows": []}
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; a layer's MLP weights {layer_bytes / 1e6:.1f} MB", flush=True)

    # cuBLAS: the two GEMMs of a layer at M = 64 (no SwiGLU, no norms), 24 layers in one graph
    h = torch.randn(BATCH, HID, device=dev, dtype=bf)
    act = torch.randn(BATCH, INTER, device=dev, dtype=bf)
    wg = [w_gu[i * 2 * INTER:(i + 1) * 2 * INTER] for i in range(LAYERS)]
    wd = [w_d[i * HID:(i + 1) * HID] for i in range(LAYERS)]

    def cublas():
        for i in range(LAYERS):
            torch.nn.functional.linear(h, wg[i])
            torch.nn.functional.linear(act, wd[i])
    t = timed(cublas) / LAYERS
    res["cublas_two_gemms_us"] = t
    print(f"cuBLAS gate/up + down GEMMs, M = 64: {t:.2f} us a layer ({layer_bytes / t / 1e6:.2f} TB/s)", flush=True)

    # correctness of the dealing and the MMAs, 2 layers, P = sms
    bar = torch.zeros(1, device=dev, dtype=torch.int32)
    for xload in (False, True):
        out = torch.zeros(sms, BR, 64, device=dev, dtype=torch.float32)
        bar.zero_()
        launch(w_gu, w_d, x, out, bar, sms, 2, 4, True, True, xload, descs)
        torch.cuda.synchronize()
        ref = reference(w_gu, w_d, x, sms, 2, xload)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"check xload={xload}: relative error {err:.2e}; barrier counter {int(bar.item())} "
              f"(expected {4 * sms})", flush=True)
        res[f"check_xload{int(xload)}"] = {"rel_err": err, "counter": int(bar.item())}
        if not err < 1e-4 or int(bar.item()) != 4 * sms:
            print("CHECK FAILED", flush=True)
            return 1

    out = torch.zeros(2 * sms, BR, 64, device=dev, dtype=torch.float32)
    configs = []
    for P, depths in ((sms, (2, 4, 8, 12)), (2 * sms, (4, 6))):
        for D in depths:
            for sync, compute, xload in ((0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (1, 1, 1)):
                smem = D * 16384 + (D if xload else 1) * 8192
                if smem > (220 << 10) // (P // sms):
                    continue
                configs.append((P, D, sync, compute, xload))
    print(f"\n{'P':>4} {'D':>3} {'sync':>4} {'mma':>4} {'xload':>5} {'us/layer':>9} {'TB/s':>6}", flush=True)
    for P, D, sync, compute, xload in configs:
        def run(P=P, D=D, sync=sync, compute=compute, xload=xload):
            bar.zero_()
            launch(w_gu, w_d, x, out, bar, P, LAYERS, D, bool(sync), bool(compute), bool(xload), descs)
        try:
            t = timed(run) / LAYERS
        except Exception as exc:  # noqa: BLE001 - a plan that does not compile or launch is reported, not fatal
            print(f"{P:>4} {D:>3} {sync:>4} {compute:>4} {xload:>5}  failed: {type(exc).__name__}: {str(exc)[:100]}",
                  flush=True)
            continue
        ok = (not sync) or int(bar.item()) == 2 * LAYERS * P
        res["rows"].append({"P": P, "D": D, "sync": sync, "mma": compute, "xload": xload, "us_per_layer": t,
                            "tb_s": layer_bytes / t / 1e6, "counter_ok": ok})
        print(f"{P:>4} {D:>3} {sync:>4} {compute:>4} {xload:>5} {t:>9.2f} {layer_bytes / t / 1e6:>6.2f}"
              f"{'' if ok else '  BARRIER COUNT WRONG'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

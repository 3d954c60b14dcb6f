"""What a persistent decode-step kernel could take at best: a step's bytes streamed through the SMs across the
step's dependent phases, with no kernel boundaries (Gluon, Hopper). An experiment for issue 18, which the engine
does not call.

Issue 18's 8x target needs the Qwen2-0.5B decode step at 64 streams in ~0.40 ms with the host; the engine's chain
of ~170 kernels takes ~0.9 ms on an H100 while its bytes (weights, LM head, the K/V of ~190 positions a stream:
1.14 GB) take 0.385 ms to read. Sessions 14-15 measured persistent kernels for the MLP half of a layer and found
each grid barrier costs about what a PDL kernel boundary does (~1.2 us), and that a program whose weight slices
fill its shared memory stops asking for weights while it waits at a barrier (tma_mlp.py). What was never measured
is the floor of the design every fast persistent decoder uses: a producer warp that streams the weights through a
ring of shared-memory stages **without ever waiting for the activations** (weights do not depend on them), while
the compute warps alone wait at the phase barriers. Then a barrier stalls the stream only when the ring is full.

The kernel here streams a list of phases (each a range of 8 or 16 KB weight boxes, dealt to the programs in turn)
in that form:

* the producer partition (one warp): for every phase, for every box of this program: wait for a free stage, TMA
  the box in. It never looks at the barrier counter.
* the default partition (4 warps): for every phase: with `SYNC`, the grid barrier (a monotonic counter, the same
  barrier as persistent_mlp.py); then for every box of this program: wait until it landed and free its stage.
  With `MMA`, each box is also an operand: the phase's activation chunk for the box (64 rows x 64 columns, by TMA
  from the buffer the previous phase wrote: a real cross-SM dependency through L2) times the box (warpgroup MMA,
  both operands in shared memory), accumulated in registers and written out at the phase's end (the next phase's
  activations), so the time includes the activation traffic and the arithmetic a batch of 64 rows costs.

The phases of a decode step (`step_phases`): for each layer qkv, attention (its K/V bytes), o, gate/up, down; then
the LM head. Every program counts the boxes it consumed a phase (`counts`), which the tests check against the
deal, and the counter ends at phases x programs.

Measured (docs/benchmarks/generate.md, session 50; benchmarks/gpu_megakernel_floor.py, two H100s): the stream alone
reads the step's bytes as fast as torch does (388-400 us against 385-392); the step's 121 phases with grid barriers
and no arithmetic take 519-527 us (the barriers alone 176-180 us, a third of it hidden by the stream); with the
64-row products 822-834 us, against the engine's 909-913 us and the 386-480 us a step that 8x needs on that card.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from surge.engines.kernels.persistent_mlp import SPIN_LIMIT, SPIN_PTX

ROWS = 64  # the decode batch: the MMA's M side
CHUNK = 64  # a box's columns: 128-byte rows (the 128-byte swizzle)
SMEM_LIMIT = 227 * 1024
_ROWS = gl.constexpr(ROWS)  # the kernel's view


@gluon.jit
def _grid_sync(bar_ptr, target):
    gl.thread_barrier()  # the partition's stores of the phase precede its arrival
    gl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    gl.inline_asm_elementwise(SPIN_PTX, "=r,l,r,r", [bar_ptr, target, gl.full((), SPIN_LIMIT, gl.int32)],
                              dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()


@gluon.jit
def _producer(w_desc, ring, ready, empty, bounds_ptr, n_phases, STAGES: gl.constexpr):
    p = gl.program_id(0)
    nprog = gl.num_programs(0)
    BOX: gl.constexpr = w_desc.block_type.shape[0]
    it = 0
    for ph in range(n_phases):
        b0 = gl.load(bounds_ptr + ph)
        b1 = gl.load(bounds_ptr + ph + 1)
        for j in range(b0 + p, b1, nprog):
            s = it % STAGES
            # a fresh mbarrier counts as having completed the phase before its first: the first pass does not wait
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [j * BOX, 0], ready.index(s), ring.index(s))
            it += 1


@gluon.jit
def _issue_act(act_desc, a_ring, a_ready, ait, j, b0, kch, src, ASTAGES: gl.constexpr):
    a = ait % ASTAGES
    mbarrier.expect(a_ready.index(a), act_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(act_desc, [0, src + ((j - b0) % kch) * 64], a_ready.index(a), a_ring.index(a))


@gluon.jit
def _consumer(ring, ready, empty, a_ring, a_ready, act_desc, act_ptr, act_width, bounds_ptr, kch_ptr, n_phases,
              bar_ptr, counts_ptr, SYNC: gl.constexpr, MMA: gl.constexpr, STAGES: gl.constexpr,
              ASTAGES: gl.constexpr, num_warps: gl.constexpr):
    p = gl.program_id(0)
    nprog = gl.num_programs(0)
    BOX: gl.constexpr = ring.type.shape[1]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BOX, 16])
    it = 0
    ait = 0
    arrivals = 0
    # a phase's bounds are asked for before its barrier (they are constants), so their round trip overlaps it
    b1 = gl.load(bounds_ptr)
    for ph in range(n_phases):
        b0 = b1
        b1 = gl.load(bounds_ptr + ph + 1)
        if MMA:
            kch = gl.load(kch_ptr + ph)
        if SYNC:
            arrivals += nprog
            _grid_sync(bar_ptr, arrivals)
        mine = gl.maximum(b1 - b0 - p + nprog - 1, 0) // nprog
        if MMA:
            # activations in two halves of act: a phase reads the half the phase before wrote
            src = (ph % 2) * act_width
            dst = act_width - src
            acc = gl.zeros([_ROWS, BOX], gl.float32, acc_layout)
            for q in gl.static_range(ASTAGES):
                if q < mine:
                    _issue_act(act_desc, a_ring, a_ready, ait + q, b0 + p + q * nprog, b0, kch, src, ASTAGES)
        for q in range(mine):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if MMA:
                a = ait % ASTAGES
                mbarrier.wait(a_ready.index(a), (ait // ASTAGES) & 1)
                acc = warpgroup_mma(a_ring.index(a), ring.index(s).permute((1, 0)), acc)
                if q + ASTAGES < mine:
                    _issue_act(act_desc, a_ring, a_ready, ait + ASTAGES, b0 + p + (q + ASTAGES) * nprog, b0, kch,
                               src, ASTAGES)
                ait += 1
            mbarrier.arrive(empty.index(s), count=1)
            it += 1
        if MMA:
            # the phase's output: the next phase's activations (columns by program, wrapped to the half)
            rows = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, acc_layout))
            cols = dst + (p * BOX) % act_width + gl.arange(0, BOX, layout=gl.SliceLayout(0, acc_layout))
            gl.store(act_ptr + rows[:, None] * (2 * act_width) + cols[None, :], acc.to(act_ptr.dtype.element_ty),
                     mask=(rows[:, None] >= 0) & (mine > 0))
            # the next phase reads them by TMA (the async proxy) on other SMs
            gl.inline_asm_elementwise("fence.proxy.async.global; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)
        gl.store(counts_ptr + ph * nprog + p, mine)  # one program a slot: no atomic, nothing waits for it


@gluon.jit
def _stream_floor(w_desc, act_desc, act_ptr, act_width, bounds_ptr, kch_ptr, n_phases, bar_ptr, counts_ptr,
                  SYNC: gl.constexpr, MMA: gl.constexpr, STAGES: gl.constexpr, ASTAGES: gl.constexpr,
                  num_warps: gl.constexpr):
    dt: gl.constexpr = w_desc.dtype
    ring = gl.allocate_shared_memory(dt, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    a_ring = gl.allocate_shared_memory(dt, [ASTAGES] + act_desc.block_type.shape, act_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_ready = gl.allocate_shared_memory(gl.int64, [ASTAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(ASTAGES):
        mbarrier.init(a_ready.index(i), count=1)
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (ring, ready, empty, a_ring, a_ready, act_desc, act_ptr, act_width, bounds_ptr, kch_ptr,
                     n_phases, bar_ptr, counts_ptr, SYNC, MMA, STAGES, ASTAGES, num_warps)),
        (_producer, (w_desc, ring, ready, empty, bounds_ptr, n_phases, STAGES)),
    ], [1], [40])


def step_phases(layers: int, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                batch: int, context: int, box_bytes: int) -> list[tuple[str, int, int]]:
    """A decode step's dependent phases as (name, boxes, K chunks of its activation): for each layer qkv, the
    attention's K/V bytes (batch x context positions), o, gate/up, down; then the LM head. Boxes round up."""
    def boxes(nbytes):
        return -(-nbytes // box_bytes)

    q = heads * head_dim
    kv = 2 * kv_heads * head_dim
    out = []
    for _ in range(layers):
        out += [("qkv", boxes((q + kv) * hidden * 2), hidden // CHUNK),
                ("attention", boxes(batch * context * kv * 2), head_dim // CHUNK),
                ("o", boxes(hidden * q * 2), q // CHUNK),
                ("gate_up", boxes(2 * inter * hidden * 2), hidden // CHUNK),
                ("down", boxes(hidden * inter * 2), inter // CHUNK)]
    out.append(("lm_head", boxes(vocab * hidden * 2), hidden // CHUNK))
    return out


class StreamFloor:
    """The probe for one list of phases on this GPU: `weights` holds every phase's boxes back to back (BF16, random
    unless given: what is streamed is bytes, not a model). `run(sync, mma)` is one launch; `counts` [phases, programs] and the
    barrier counter say what it consumed."""

    def __init__(self, phases: list[tuple[str, int, int]], box_rows: int = 128, stages: int = 12, astages: int = 2,
                 programs: int | None = None, device: str = "cuda", weights: torch.Tensor | None = None):
        self.phases = phases
        self.box_rows = box_rows
        self.stages = stages
        self.astages = astages
        props = torch.cuda.get_device_properties(device)
        self.programs = programs or props.multi_processor_count
        if self.programs > props.multi_processor_count:
            raise ValueError("one program an SM: the ring fills its shared memory")
        smem = (stages * box_rows + astages * ROWS) * CHUNK * 2
        if smem > SMEM_LIMIT - 2048:
            raise ValueError(f"{stages} stages of {box_rows} rows need {smem} bytes of shared memory")
        bounds = [0]
        for _, n, _ in phases:
            bounds.append(bounds[-1] + n)
        self.total_boxes = bounds[-1]
        self.nbytes = self.total_boxes * box_rows * CHUNK * 2
        g = torch.Generator(device=device).manual_seed(0)
        shape = (self.total_boxes * box_rows, CHUNK)
        if weights is None:
            weights = torch.randn(shape, device=device, generator=g, dtype=torch.float32).to(torch.bfloat16)
        elif weights.shape != shape or weights.dtype != torch.bfloat16:
            raise ValueError(f"weights must be BF16 {shape}, not {weights.dtype} {tuple(weights.shape)}")
        self.weights = weights
        self.bounds = torch.tensor(bounds, device=device, dtype=torch.int32)
        self.kch = torch.tensor([max(1, k) for _, _, k in phases], device=device, dtype=torch.int32)
        width = max(64 * max(1, k) for _, _, k in phases)
        self.act_width = max(width, triton.next_power_of_2(self.programs * box_rows))
        self.act = (torch.randn((ROWS, 2 * self.act_width), device=device, generator=g) * 0.01).to(torch.bfloat16)
        self.counter = torch.zeros(1, device=device, dtype=torch.int32)
        self.counts = torch.zeros((len(phases), self.programs), device=device, dtype=torch.int32)
        w_layout = gl.NVMMASharedLayout.get_default_for([box_rows, CHUNK], gl.bfloat16)
        a_layout = gl.NVMMASharedLayout.get_default_for([ROWS, CHUNK], gl.bfloat16)
        self.w_desc = TensorDescriptor.from_tensor(self.weights, [box_rows, CHUNK], w_layout)
        self.a_desc = TensorDescriptor.from_tensor(self.act, [ROWS, CHUNK], a_layout)

    def deal(self) -> torch.Tensor:
        """The boxes each program should consume a phase: [phases, programs]."""
        n = torch.tensor([b for _, b, _ in self.phases], dtype=torch.int64)[:, None]
        p = torch.arange(self.programs)[None, :]
        return ((n - p + self.programs - 1).clamp(min=0) // self.programs).to(torch.int32)

    def reset(self) -> None:
        """Zero the barrier counter and the counts: before every launch."""
        self.counter.zero_()
        self.counts.zero_()

    def run(self, sync: bool = True, mma: bool = False) -> None:
        self.reset()
        self.launch(sync, mma)

    def launch(self, sync: bool = True, mma: bool = False) -> None:
        """One launch (after `reset`). mma: each box is multiplied by its activation chunk, read from the half of
        `act` [64, 2W] the phase before wrote (the first phase: columns [0, W)), and a program writes its [64, box
        rows] sum to the other half at columns (program x box rows) mod W."""
        _stream_floor[(self.programs,)](self.w_desc, self.a_desc, self.act, self.act_width, self.bounds, self.kch,
                                        len(self.phases), self.counter, self.counts, SYNC=sync, MMA=mma,
                                        STAGES=self.stages, ASTAGES=self.astages, num_warps=4)

"""A module's LoRA deltas in one kernel (kernels/lora_delta.py) on a CUDA GPU: against float64 on fresh random
inputs, as close as the torch form (engines/decoder/lora.py's) is; base rows untouched bit for bit; a row's
bits independent of its batch and of the slots other rows use; PDL and CUDA graphs give the same bits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


def _inputs(m, k, n, slots, width, seed, out_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    x = torch.randn(m, k, generator=g).to("cuda", dt)
    a = (torch.randn(slots * width, k, generator=g) / k ** 0.5).to("cuda", dt)
    b = (torch.randn(n, slots * width, generator=g) * 0.2).to("cuda", dt)
    rows = torch.randint(0, slots + 1, (m,), generator=g)
    rows[0], rows[-1] = 0, slots  # a base row and an adapter row whatever the draw
    rows = rows.to("cuda")
    out = torch.randn(m, n, generator=g).to("cuda", out_dtype)
    return x, a, b, rows, out


def _mask(rows, slots, width, dtype):
    return (rows.view(-1, 1) == torch.arange(slots * width, device=rows.device) // width + 1).to(dtype)


def _torch_form(out, x, a, b, rows, slots, width):
    xa = torch.nn.functional.linear(x, a) * _mask(rows, slots, width, x.dtype)
    return out.clone().add_(torch.nn.functional.linear(xa, b))


# Qwen2-0.5B's modules at rank 16 (qkv: 3 parts, gate/up: 2) and a prefill's rows; ranks past one 64-wide chunk
@pytest.mark.parametrize("m,k,n,slots,width", [(64, 896, 1152, 2, 48), (64, 4864, 896, 2, 16),
                                               (37, 896, 9728, 4, 32), (200, 896, 896, 3, 16),
                                               (5, 256, 200, 8, 24)])
@pytest.mark.parametrize("out_dtype", ["bf16", "fp32"])
def test_lora_add_against_float64_and_the_torch_form(m, k, n, slots, width, out_dtype):
    from surge.engines.kernels.lora_delta import lora_add_

    odt = {"bf16": torch.bfloat16, "fp32": torch.float32}[out_dtype]
    x, a, b, rows, out = _inputs(m, k, n, slots, width, seed=m + k + n, out_dtype=odt)
    got = lora_add_(out.clone(), x, a, b, rows, width)
    ref = out.double() + ((x.double() @ a.double().T) * _mask(rows, slots, width, torch.float64)) @ b.double().T
    err = (got.double() - ref).abs().max().item()
    err_torch = (_torch_form(out, x, a, b, rows, slots, width).double() - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert torch.isfinite(got).all()
    assert err <= 2 * err_torch + 1e-3 * scale, (err, err_torch, scale)
    base = rows == 0
    assert base.any() and torch.equal(got[base], out[base])
    assert not torch.equal(got[~base], out[~base])


def test_lora_add_rows_independent_of_their_batch():
    """A row's bits alone, in a mixed batch, and in a batch where only its slot is used (the other chunks
    skipped) are the same; PDL and a CUDA graph replay change no bit."""
    from surge.engines.kernels.lora_delta import lora_add_

    slots, width = 4, 32
    x, a, b, rows, out = _inputs(64, 896, 1152, slots, width, seed=7)
    rows[:8] = torch.tensor([1, 2, 3, 4, 0, 1, 2, 3], device="cuda")
    mixed = lora_add_(out.clone(), x, a, b, rows, width)
    for i in range(8):
        alone = lora_add_(out[i:i + 1].clone(), x[i:i + 1], a, b, rows[i:i + 1], width)
        assert torch.equal(alone[0], mixed[i]), i
    one = torch.where(rows == 1, rows, torch.zeros_like(rows))
    only = lora_add_(out.clone(), x, a, b, one, width)
    assert torch.equal(only[rows == 1], mixed[rows == 1])
    assert torch.equal(only[rows != 1], out[rows != 1])
    from surge.engines.kernels import pdl

    if pdl.supported():
        assert torch.equal(lora_add_(out.clone(), x, a, b, rows, width, pdl=True), mixed)
    buf = out.clone()
    graph = torch.cuda.CUDAGraph()
    lora_add_(buf, x, a, b, rows, width)  # compiled before the capture
    buf.copy_(out)
    with torch.cuda.graph(graph):
        lora_add_(buf, x, a, b, rows, width, pdl=pdl.supported())
    buf.copy_(out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(buf, mixed)
    # the slots are read at replay: new rows' slots, new deltas
    rows.copy_(torch.flip(rows, [0]))
    buf.copy_(out)
    graph.replay()
    assert torch.equal(buf, lora_add_(out.clone(), x, a, b, rows, width))


def test_the_shrink_beside_the_module_gemm(tmp_path):
    """LoraStep.begin runs x A^T on a side stream while the module's own GEMM runs; finish_ then adds the rest:
    the same bits as both kernels on one stream, eagerly (a long GEMM between them, so a missing wait would
    read unfinished partials) and replayed from a CUDA graph, every module of a layer."""
    from surge.engines.decoder.lora import LoraBank
    from surge.engines.kernels.lora_delta import lora_add_
    from surge.models.decoder import load_decoder_config
    from tests.decoder_models import build_model

    cfg = load_decoder_config(build_model("qwen2", tmp_path / "m", seed=1, hidden_size=256, intermediate_size=512))
    bank = LoraBank(cfg, 3, 16, "cuda", torch.bfloat16)
    assert bank.kernel
    g = torch.Generator().manual_seed(3)
    for t in list(bank.a.values()) + list(bank.b.values()):
        t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    slots = torch.tensor([0, 1, 2, 3] * 16, device="cuda")
    big = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    step = bank.step(slots)
    for module, width in bank.width.items():
        a, b = bank.a[0, module], bank.b[0, module]
        x = torch.randn(64, a.shape[1], generator=g).to("cuda", torch.bfloat16)
        base = torch.randn(64, b.shape[0], generator=g).to("cuda", torch.bfloat16)
        want = lora_add_(base.clone(), x, a, b, slots, width)

        def run(out):
            pending = step.begin(x, 0, module)
            for _ in range(4):  # the "module GEMM": long enough that the side stream's kernel finishes later
                torch.mm(big, big)
            return pending.finish_(out)

        assert torch.equal(run(base.clone()), want), module
        buf = base.clone()
        run(buf)  # warm
        graph = torch.cuda.CUDAGraph()
        buf.copy_(base)
        with torch.cuda.graph(graph):
            run(buf)
        buf.copy_(base)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(buf, want), module


def _gemm_cases():
    from surge.engines.kernels.gate_up import GateUpPlan
    from surge.engines.kernels.splitk_gemm import PLANS, SplitKPlan

    # (kind, plan, M, K, N of the weight, slots, width): the engine's measured Qwen2-0.5B / Llama-1B plans (TMA and
    # pointer, swapped and not; pipelines shortened for A's tiles), one K step and several, up to JOIN_MAX_R = 128
    # stacked columns (120: not a power of two), a short batch
    return [("splitk", PLANS[1152, 896], 64, 896, 1152, 2, 48), ("splitk", PLANS[896, 896], 64, 896, 896, 4, 16),
            ("splitk", PLANS[896, 4864], 37, 4864, 896, 3, 32), ("splitk", PLANS[2048, 8192], 64, 8192, 2048, 2, 16),
            ("splitk", SplitKPlan(64, 128, 3, swap=True), 5, 512, 200, 5, 24),
            ("gate_up", GateUpPlan(64, 128, num_stages=4, tma=True), 64, 896, 2 * 4864, 2, 32),
            ("gate_up", GateUpPlan(32, 128, num_stages=3), 19, 896, 2 * 4864, 4, 32),
            ("gate_up", GateUpPlan(32, 64, swap=True), 64, 256, 2 * 512, 3, 40)]


def _gemm(kind, plan, x, w, lora=None, pdl=False):
    from surge.engines.kernels.gate_up import gate_up_silu
    from surge.engines.kernels.splitk_gemm import partials

    if kind == "splitk":
        return partials(x, w, plan, pdl=pdl, lora=lora)
    return gate_up_silu(x, w, plan, pdl=pdl, lora=lora)


def _silu_mul64(y):
    g, u = y.chunk(2, dim=-1)
    return g / (1 + torch.exp(-g)) * u


@pytest.mark.parametrize("case", range(8))
def test_gemm_kernels_join_the_deltas(case):
    """The split-K GEMM and the one-kernel gate/up with the LoRA operands (each split adding its K range's share,
    gate/up's halves before the SiLU): against float64 as close as the two-kernel delta on top of the same GEMM
    is; base rows' bits those of the GEMM without LoRA; a row's bits alone = in its mixed batch = in a batch
    where only its slot is used; PDL and a CUDA graph replay (slots read at replay) give the same bits."""
    from surge.engines.kernels import pdl
    from surge.engines.kernels.lora_delta import LoraOperands, lora_add_
    from surge.engines.kernels.splitk_gemm import reduce_partials

    kind, plan, m, k, n, slots, width = _gemm_cases()[case]
    x, a, b, rows, _ = _inputs(m, k, n, slots, width, seed=100 + case)
    g = torch.Generator().manual_seed(case)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to("cuda", torch.bfloat16)
    ops = LoraOperands(a, b, rows, width)
    got = _gemm(kind, plan, x, w, ops)
    plain = _gemm(kind, plan, x, w)
    full = x.double() @ w.double().T + ((x.double() @ a.double().T) * _mask(rows, slots, width, torch.float64)
                                        ) @ b.double().T
    if kind == "splitk":
        ref, value = full, got.sum(0).double()
        two_kernel = lora_add_(reduce_partials(plain, dtype=torch.float32), x, a, b, rows, width).double()
    else:
        ref, value = _silu_mul64(full), got.double()
        from surge.engines.kernels.decoder_fused import silu_mul

        product = lora_add_(torch.nn.functional.linear(x, w), x, a, b, rows, width)
        two_kernel = silu_mul(product).double()
    err, err_two = (value - ref).abs().max().item(), (two_kernel - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert torch.isfinite(value).all()
    assert err <= 2 * err_two + 1e-3 * scale, (err, err_two, scale)
    base = rows == 0
    rows_of = (lambda t, r: t[:, r]) if kind == "splitk" else (lambda t, r: t[r])
    assert base.any() and torch.equal(rows_of(got, base), rows_of(plain, base))
    assert not torch.equal(rows_of(got, ~base), rows_of(plain, ~base))
    for i in (m - 1, int(torch.nonzero(~base)[0])):
        alone = _gemm(kind, plan, x[i:i + 1], w, LoraOperands(a, b, rows[i:i + 1], width))
        assert torch.equal(rows_of(alone, 0), rows_of(got, i)), i
    one = torch.where(rows == slots, rows, torch.zeros_like(rows))
    only = _gemm(kind, plan, x, w, LoraOperands(a, b, one, width))
    assert torch.equal(rows_of(only, rows == slots), rows_of(got, rows == slots))
    if pdl.supported():
        assert torch.equal(_gemm(kind, plan, x, w, ops, pdl=True), got)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _gemm(kind, plan, x, w, ops, pdl=pdl.supported())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
    rows.copy_(torch.flip(rows, [0]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _gemm(kind, plan, x, w, LoraOperands(a, b, rows, width)))


def test_gemm_kernels_refuse_lora_operands_that_do_not_fit():
    from surge.engines.kernels.lora_delta import LoraOperands
    from surge.engines.kernels.splitk_gemm import PLANS

    x, a, b, rows, _ = _inputs(8, 896, 896, 2, 16, seed=3)
    w = torch.randn(896, 896, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not fit"):
        _gemm("splitk", PLANS[896, 896], x, w, LoraOperands(a, b[:100], rows, 16))
    with pytest.raises(ValueError, match="do not fit"):
        _gemm("splitk", PLANS[896, 896], x, w, LoraOperands(a, b, rows[:4], 16))
    x, a, b, rows, _ = _inputs(8, 896, 896, 9, 16, seed=4)  # 144 stacked columns
    with pytest.raises(ValueError, match="at most 128"):
        _gemm("splitk", PLANS[896, 896], x, w, LoraOperands(a, b, rows, 16))


def test_a_bank_past_the_join_limit_takes_the_two_kernels(tmp_path):
    """LoraStep.operands: the joined form where a module's stacked rank fits JOIN_MAX_R, None (the two delta
    kernels) past it, and None when the bank is told not to join."""
    from surge.engines.decoder.lora import LoraBank
    from surge.models.decoder import load_decoder_config
    from tests.decoder_models import build_model

    cfg = load_decoder_config(build_model("qwen2", tmp_path / "m", seed=1, hidden_size=256, intermediate_size=512))
    slots = torch.zeros(4, dtype=torch.long, device="cuda")
    two = LoraBank(cfg, 2, 16, "cuda", torch.bfloat16).step(slots)  # qkv 2 x 48 = 96 columns, the rest 32-64
    assert all(two.operands(0, m) is not None for m in two.bank.width)
    three = LoraBank(cfg, 3, 16, "cuda", torch.bfloat16).step(slots)  # qkv 144 columns, up_gate 96, o / down 48
    assert three.operands(0, "qkv") is None and three.operands(0, "o") is not None
    apart = LoraBank(cfg, 2, 16, "cuda", torch.bfloat16, join=False).step(slots)
    assert all(apart.operands(0, m) is None for m in apart.bank.width)

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

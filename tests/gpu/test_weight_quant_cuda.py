"""8-bit weights (models/weight_quant.py, --generation quantization=fp8 | int8) on a CUDA GPU: the decode step's split-K
and gate/up kernels on FP8 and INT8 tiles against float64 products of the dequantized weights (TMA and pointer,
swapped and not, PDL, a row's bits alone = in its batch, LoRA deltas joined after the scales); the engine against
transformers running the dequantized weights; the weights' memory halved; quantized checkpoints' own bytes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda

# Qwen2-0.5B's and Llama-1B's layer GEMMs (N, K), and one whose K is no multiple of the tiles
SHAPES = [(1152, 896), (896, 896), (896, 4864), (3072, 2048), (2048, 2048), (2048, 8192), (200, 1000)]


KINDS = ["fp8", "int8"]


def _need(kind):
    from surge.models.weight_quant import supported

    if not supported(torch.device("cuda"), kind):
        pytest.skip(f"{kind} weights need compute capability {'8.9' if kind == 'fp8' else '8.0'}+")


def _need_fp8_rows():
    from surge.engines.kernels import fp8_rows

    if not fp8_rows.supported():
        pytest.skip("FP8 products with row-wise scales need a Hopper-class GPU and torch._scaled_mm")


# the modules whose inputs the engine rounds to FP8 rows with fp8_activations (transformers' names)
FP8_INPUT_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "c_attn", "c_fc")


# W8A8 is not continuous: where the engine's BF16 activations and transformers' differ in a last bit, a row's FP8
# code can move a whole E4M3 step (1/8 to 1/16 of the value), so the logits of a W8A8 engine sit further from the
# reference than the 5% of their range a BF16 engine's do; the greedy checks (partings only at near-ties) are the
# same
W8A8_LOGIT_TOL = 0.1


def fp8_input_rows(model):
    """transformers' model with the inputs of the norm-fed products rounded as the engine's FP8 rows are
    (models/weight_quant.quantize_rows, then q * scale in the model's dtype)."""
    from surge.models.weight_quant import quantize_rows

    def hook(module, args):  # from the input in BF16, as the engine's norm rounds it before quantizing
        x = args[0]
        q, s = quantize_rows(x.reshape(-1, x.shape[-1]).to(torch.bfloat16))
        return ((q.float() * s).to(x.dtype).reshape(x.shape),) + tuple(args[1:])

    hooked = [m.register_forward_pre_hook(hook) for name, m in model.named_modules()
              if name.rsplit(".", 1)[-1] in FP8_INPUT_NAMES]
    assert hooked, "no module of the reference takes FP8 rows"
    return model


def _q8(n, k, seed, kind="fp8"):
    """A random [n, k] weight whose rows span a 40x range of magnitudes (the per-row scales matter), as the
    engine quantizes it (from BF16): (q, scale, the dequantized weight in float64)."""
    from surge.models.weight_quant import quantize

    _need(kind)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k ** 0.5 * (torch.rand(n, 1, generator=g) * 4 + 0.1)
    q, s = quantize(w.to("cuda", torch.bfloat16), kind)
    return q, s, q.double() * s.double()[:, None]


def _x(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)


def _splitk_plans(n, k):
    from surge.engines.kernels.splitk_gemm import SplitKPlan, default_plan, q8_plan_for

    return [q8_plan_for(n, k), default_plan(n, k), SplitKPlan(64, 128, 7, num_stages=1),
            SplitKPlan(32, 64, 5, num_stages=3, swap=True), SplitKPlan(64, 256, 2, num_stages=3, tma=True),
            SplitKPlan(32, 128, 4, num_stages=4, swap=True, tma=True)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", SHAPES)
def test_splitk_on_8bit_weights_equals_float64(n, k, kind):
    """Every split written (the workspace poisoned with NaN), the FP32 sums within 1e-5 of the float64 product
    with the dequantized weight (the FP8 tiles convert exactly; the scales multiply FP32 sums), the linear's
    one BF16 rounding (bias after the sum) within half an ulp; a row's bits alone = in a batch of 64; PDL the
    same bits."""
    from surge.engines.kernels import pdl
    from surge.engines.kernels.splitk_gemm import linear, partials

    q, s, wd = _q8(n, k, n + k, kind)
    bias = _x(1, n, 7)[0]
    for plan in _splitk_plans(n, k):
        for m in (1, 7, 33, 64):
            a = _x(m, k, m)
            ref = a.double() @ wd.T
            ws = torch.full((plan.num_splits(k), m, n), float("nan"), device="cuda")
            part = partials(a, q, plan, out=ws, scale=s)
            torch.cuda.synchronize()
            assert not part.isnan().any(), (plan, m)
            err = ((part.double().sum(0) - ref).norm() / ref.norm()).item()
            assert err < 1e-5, (plan, m, err)
            want = ref + bias.double()
            out = linear(a, q, plan, bias, scale=s)
            tol = want.abs() * 2.0 ** -8 + 1e-5 * want.abs().max()
            assert ((out.double() - want).abs() <= tol).all(), (plan, m)
        a = _x(64, k, 99)
        full = partials(a, q, plan, scale=s)
        for i in (0, 37, 63):
            assert torch.equal(partials(a[i:i + 1], q, plan, scale=s)[:, 0], full[:, i]), (plan, i)
        if pdl.supported():
            assert torch.equal(partials(a, q, plan, pdl=True, scale=s), full), plan


def _gate_up_ref(x, wd):
    """silu_mul's rounding on the float64 products with the dequantized weight."""
    i = wd.shape[0] // 2
    g = (x.double() @ wd[:i].T).to(x.dtype).double()
    u = (x.double() @ wd[i:].T).to(x.dtype).double()
    return (g * torch.sigmoid(g)).to(x.dtype).double() * u


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("i,k", [(4864, 896), (8192, 2048), (200, 200)])
def test_gate_up_on_8bit_weights_against_float64(i, k, kind):
    """Each half's sums scaled by its own rows' scales (gate rows, then up rows I further) before the SiLU: as close
    to float64 as cuBLAS + silu_mul on the dequantized BF16 weight; a row's bits alone = in its batch; PDL the same."""
    import torch.nn.functional as F

    from surge.engines.kernels import pdl
    from surge.engines.kernels.decoder_fused import silu_mul
    from surge.engines.kernels.gate_up import GateUpPlan, default_plan, q8_plan_for, gate_up_silu
    from surge.models.weight_quant import dequantize

    q, s, wd = _q8(2 * i, k, i, kind)
    plans = [q8_plan_for(i, k), default_plan(i, k), GateUpPlan(16, 64, 4, 2, True), GateUpPlan(32, 256, 4, 4, True),
             GateUpPlan(64, 128, 4, 4, False, True), GateUpPlan(32, 128, 4, 3, True, True)]
    for m in (1, 7, 64):
        x = _x(m, k, m + 1)
        ref = _gate_up_ref(x, wd)
        pair = silu_mul(F.linear(x, dequantize(q, s, torch.bfloat16)), torch.bfloat16)
        pair_err = ((pair.double() - ref).norm() / ref.norm()).item()
        for plan in plans:
            out = gate_up_silu(x, q, plan, scale=s)
            assert out.shape == (m, i) and not out.isnan().any()
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < max(2 * pair_err, 2e-3), (m, plan, err, pair_err)
    x = _x(64, k, 5)
    for plan in plans:
        full = gate_up_silu(x, q, plan, scale=s)
        for n in (1, 33):
            assert torch.equal(gate_up_silu(x[:n], q, plan, scale=s), full[:n]), (plan, n)
        if pdl.supported():
            assert torch.equal(gate_up_silu(x, q, plan, pdl=True, scale=s), full), plan


def test_8bit_kernels_refuse_a_weight_without_its_scales():
    from surge.engines.kernels.gate_up import gate_up_silu
    from surge.engines.kernels.splitk_gemm import default_plan, partials

    q, s, _ = _q8(64, 128, 1, "int8")
    x = _x(4, 128, 1)
    with pytest.raises(ValueError, match="needs its per-row scales"):
        partials(x, q, default_plan(64, 128))
    with pytest.raises(ValueError, match="scale must be"):
        partials(x, q, default_plan(64, 128), scale=s[:10])
    with pytest.raises(ValueError, match="scale must be"):
        partials(x, q.to(torch.bfloat16), default_plan(64, 128), scale=s)
    with pytest.raises(ValueError, match="needs its per-row scales"):
        from surge.engines.kernels.gate_up import default_plan as gu_plan

        gate_up_silu(x, q, gu_plan(32, 128))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,k", [(1152, 896), (9728, 896), (896, 4864), (200, 1000)])
def test_8bit_linear_above_the_decode_rows(n, k, kind):
    """Both 8-bit products at and above the decode step's rows: the split-K kernel (M tiles of 64, each reading the
    weight; the engine's path up to Q8_MAX_M) and cuBLAS on the weight dequantized by kernels/dequant.py (above it),
    each within BF16 roundings of the float64 product at 63 to 300 rows (bounded by the sum of |a_k w_k|: the
    dequantized weight's rounding, and cuBLAS's BF16 reductions, scale with it, not with the result); the kernel's
    bits for a row alone = in a batch of several M tiles (no M in the plan)."""
    import torch.nn.functional as F

    from surge.engines.kernels.dequant import dequantize
    from surge.engines.kernels.splitk_gemm import Q8_MAX_M, linear, partials, q8_plan_for

    q, s, wd = _q8(n, k, n + k + 1, kind)
    plan = q8_plan_for(n, k)
    for m in sorted({Q8_MAX_M - 1, Q8_MAX_M, Q8_MAX_M + 1, 100, 128, 300}):
        a = _x(m, k, m)
        ref = a.double() @ wd.T
        tol = ref.abs() * 2.0 ** -8 + (a.double().abs() @ wd.abs().T) * 2.0 ** -7
        for path, out in (("kernel", linear(a, q, plan, scale=s)),
                          ("dequant", F.linear(a, dequantize(q, s, torch.bfloat16)))):
            assert ((out.double() - ref).abs() <= tol).all(), (m, path)
    a = _x(200, k, 5)
    full = partials(a, q, plan, scale=s)
    for i in (0, 64, 130, 199):
        assert torch.equal(partials(a[i:i + 1], q, plan, scale=s)[:, 0], full[:, i]), i


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dequant_kernel_equals_torch_bit_for_bit(kind, dtype):
    """kernels/dequant.dequantize = models/weight_quant.dequantize bit for bit (one FP32 product rounded once to
    nearest even) on shapes that do not fill its tiles, a weight whose rows are strided, into `out`; a bad shape
    or `out` is a ValueError."""
    from surge.engines.kernels.dequant import dequantize
    from surge.models.weight_quant import dequantize as reference

    dt = getattr(torch, dtype)
    for n, k in ((1152, 896), (37, 300), (5, 1000), (4864, 896)):
        q, s, _ = _q8(n, k, n * 7 + k, kind)
        want = reference(q, s, dt)
        assert torch.equal(dequantize(q, s, dt).view(torch.int16), want.view(torch.int16)), (n, k)
        wide = torch.zeros(n, k + 40, dtype=q.dtype, device="cuda")
        wide[:, 3:3 + k] = q
        out = torch.full((n, k), float("nan"), dtype=dt, device="cuda")
        assert dequantize(wide[:, 3:3 + k], s, dt, out=out) is out
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (n, k)
    with pytest.raises(ValueError, match="scale"):
        dequantize(q, s[:-1], dt)
    with pytest.raises(ValueError, match="out must be"):
        dequantize(q, s, dt, out=torch.empty(n, k + 1, dtype=dt, device="cuda"))


@pytest.mark.parametrize("kind,act", [("fp8", False), ("int8", False), ("fp8", True)])
def test_8bit_decode_steps_of_more_than_64_streams(trained_q8, kind, act):
    """96 streams: decode steps of 96 rows run the 8-bit kernel's M tiles (CUDA graphs of those buckets), prefill
    chunks of up to 512 tokens the kernel or cuBLAS on the dequantized weights (act: the qkv and gate/up products
    on FP8 rows, cuBLASLt's FP8 GEMM at every size); logits within tolerance of transformers FP32 on the
    dequantized weights (act: with those products' inputs rounded to FP8 rows), greedy tokens equal to its BF16
    generate on all 16 steps for the bulk of 96 prompts, any parting at a near-tie."""
    from tests.gpu.test_decoder_cuda import _compare_greedy, _prompts

    _need(kind)
    if act:
        _need_fp8_rows()
    d, refs = trained_q8
    prompts = _prompts(384, 96)
    equal, near, other, err, scale = _compare_greedy(d, prompts, steps=16, ref_dir=refs[kind], same_paths=False,
                                                     max_num_seqs=96, num_blocks=1024, quantization=kind,
                                                     fp8_activations=act, ref_patch=fp8_input_rows if act else None)
    print(f"{kind} (act {act}), 96 streams: {equal}/{len(prompts)} equal on 16 steps; near-ties {near}; other {other}; "
          f"max logit error {err:.4f} of scale {scale:.2f}")
    assert err < (W8A8_LOGIT_TOL if act else 0.05) * scale
    assert not other, f"divergences that are not near-ties: {other}"
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"


@pytest.mark.parametrize("quant", KINDS)
@pytest.mark.parametrize("kind", ["splitk", "gate_up"])
def test_lora_deltas_join_the_scaled_sums(kind, quant):
    """LoRA adapters on an 8-bit base (the join after the scales): against float64 (dequantized base + each row's
    own delta) within twice the two-kernel form's error; base rows' bits those of the 8-bit GEMM alone."""
    from surge.engines.kernels.decoder_fused import silu_mul
    from surge.engines.kernels.gate_up import GateUpPlan, gate_up_silu
    from surge.engines.kernels.lora_delta import LoraOperands, lora_add_
    from surge.engines.kernels.splitk_gemm import PLANS, partials, reduce_partials
    from surge.models.weight_quant import dequantize
    from tests.gpu.test_lora_delta_cuda import _inputs, _mask

    m, k, slots, width = 64, 896, 2, 32
    n = 1152 if kind == "splitk" else 2 * 4864
    q, s, wd = _q8(n, k, 21, quant)
    x, a, b, rows, _ = _inputs(m, k, n, slots, width, seed=22)
    ops = LoraOperands(a, b, rows, width)
    full = x.double() @ wd.T + ((x.double() @ a.double().T) * _mask(rows, slots, width, torch.float64)) @ b.double().T
    if kind == "splitk":
        plan = PLANS[1152, 896]
        got, plain = partials(x, q, plan, lora=ops, scale=s), partials(x, q, plan, scale=s)
        value, ref = got.sum(0).double(), full
        two = lora_add_(reduce_partials(plain, dtype=torch.float32), x, a, b, rows, width).double()
        base_rows = lambda t, r: t[:, r]  # noqa: E731
    else:
        plan = GateUpPlan(64, 128, num_stages=4, tma=True)
        got, plain = gate_up_silu(x, q, plan, lora=ops, scale=s), gate_up_silu(x, q, plan, scale=s)
        g, u = full.chunk(2, dim=-1)
        value, ref = got.double(), g / (1 + torch.exp(-g)) * u
        product = lora_add_(torch.nn.functional.linear(x, dequantize(q, s, torch.bfloat16)), x, a, b, rows, width)
        two = silu_mul(product).double()
        base_rows = lambda t, r: t[r]  # noqa: E731
    err, err_two = (value - ref).abs().max().item(), (two - ref).abs().max().item()
    assert err <= 2 * err_two + 1e-3 * ref.abs().max().item(), (err, err_two)
    base = rows == 0
    assert base.any() and torch.equal(base_rows(got, base), base_rows(plain, base))


# -- the engine --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_q8(tmp_path_factory):
    """A Qwen2-shaped model fitted as test_decoder_cuda's trained_dir is (real margins), and beside it the same
    model with each layer's linear weights replaced by their FP8 and INT8 round trips (quantized from BF16, as the
    engine quantizes): transformers runs those as the references."""
    from tests.decoder_models import build_model
    from tests.gpu.test_decoder_cuda import _fit

    d = build_model("qwen2", tmp_path_factory.mktemp("qwen2_q8"), seed=11, hidden_size=256,
                    intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                    max_position_embeddings=512)
    d = _fit(d, lr=2e-3)
    return d, {kind: _dequantized_copy(d, tmp_path_factory.mktemp(f"qwen2_{kind}_ref"), kind) for kind in KINDS}


def _dequantized_copy(d, out, kind="fp8"):
    from transformers import AutoModelForCausalLM

    from surge.models.weight_quant import dequantize, quantize

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            for lin in (*(getattr(layer.self_attn, f"{p}_proj") for p in "qkvo"), layer.mlp.gate_proj,
                        layer.mlp.up_proj, layer.mlp.down_proj):
                # per-row scales: quantizing q, k, v (gate, up) apart = quantizing their concatenation
                lin.weight.copy_(dequantize(*quantize(lin.weight.to(torch.bfloat16), kind), torch.float32))
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_8bit_engine_follows_transformers_on_the_dequantized_weights(trained_q8, kind):
    """The issue's GPU test with quantization=fp8 / int8 (CUDA graphs, overlapped and multi-step launches, PDL):
    every decode GEMM of every layer on its 8-bit plan, the layers' weights at one byte each; logits within
    tolerance of transformers FP32 on the dequantized weights, greedy tokens equal to its BF16 generate on all 32
    steps for the bulk (>= 75%) of prompts, any parting at a near-tie."""
    from surge.engines.decoder import DecoderEngine
    from surge.engines.kernels import gate_up, splitk_gemm
    from surge.models.decoder import is_layer_linear
    from surge.models.weight_quant import KINDS as DTYPES
    from tests.gpu.test_decoder_cuda import _compare_greedy, _prompts

    _need(kind)
    d, refs = trained_q8
    e = DecoderEngine(d, device="cuda", dtype="bf16", num_blocks=64, max_num_seqs=4, max_model_len=512,
                      cuda_graphs=False, quantization=kind, fp8_activations=False)
    plain = DecoderEngine(d, device="cuda", dtype="bf16", num_blocks=64, max_num_seqs=4, max_model_len=512,
                          cuda_graphs=False)
    linear = [n for n in e.model.w if is_layer_linear(n)]
    assert linear and all(e.model.w[n].dtype == DTYPES[kind] for n in linear)
    fp8_bytes = sum(e.model.w[n].nbytes for n in linear)
    assert fp8_bytes * 2 == sum(plain.model.w[n].nbytes for n in linear)
    assert e.capabilities.quantization == kind
    for i in range(e.cfg.num_layers):
        for name in ("qkv", "o", "down"):
            w = e.model.w[f"l{i}.{name}"]
            assert e.model._splitk[f"l{i}.{name}"] == splitk_gemm.q8_plan_for(*w.shape), name
        assert e.model._gate_up[f"l{i}.up_gate"] == gate_up.q8_plan_for(512, 256)
    del e, plain
    prompts = _prompts(384, 24)
    equal, near, other, err, scale = _compare_greedy(d, prompts, ref_dir=refs[kind], pdl=True, quantization=kind,
                                                     fp8_activations=False)
    print(f"{kind}: {equal}/{len(prompts)} prompts equal on 32 greedy steps; near-ties {near}; other {other}; "
          f"max logit error {err:.4f} of scale {scale:.2f}")
    assert err < 0.05 * scale
    assert not other, f"divergences that are not near-ties: {other}"
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"


def test_fp8_w8a8_engine_follows_transformers_on_fp8_rows(trained_q8):
    """quantization=fp8 on a Hopper-class GPU (fp8_activations, the default): the qkv and gate/up products take
    the norm kernels' FP8 rows into cuBLASLt's FP8 GEMM, o and down keep their 8-bit split-K plans; the engine
    says fp8-w8a8; logits within tolerance of transformers FP32 on the dequantized weights with those products'
    inputs rounded to FP8 rows, greedy tokens equal to its BF16 generate on all 32 steps for the bulk of prompts
    (CUDA graphs, overlapped and multi-step launches, PDL), any parting at a near-tie; against the weight-only
    reference it is more than twice as far off as the weight-only engine (the rows are rounded)."""
    from surge.engines.decoder import DecoderEngine
    from tests.gpu.test_decoder_cuda import _compare_greedy, _prompts

    _need("fp8")
    _need_fp8_rows()
    d, refs = trained_q8
    e = DecoderEngine(d, device="cuda", dtype="bf16", num_blocks=64, max_num_seqs=4, max_model_len=512,
                      cuda_graphs=False, quantization="fp8")
    layers = e.cfg.num_layers
    assert e.capabilities.quantization == "fp8-w8a8" == e.model.quantization
    assert e.model._fp8_act == {f"l{i}.{m}" for i in range(layers) for m in ("qkv", "up_gate")}
    assert set(e.model._splitk) == {f"l{i}.{m}" for i in range(layers) for m in ("o", "down")}
    assert not e.model._gate_up
    del e
    prompts = _prompts(384, 24)
    equal, near, other, err, scale = _compare_greedy(d, prompts, ref_dir=refs["fp8"], pdl=True, quantization="fp8",
                                                     ref_patch=fp8_input_rows)
    # the rows are rounded: against the weight-only reference this engine is further off than the weight-only engine
    _, _, _, err_w8a8, _ = _compare_greedy(d, prompts[:4], steps=8, ref_dir=refs["fp8"], quantization="fp8",
                                           same_paths=False)
    _, _, _, err_w8, _ = _compare_greedy(d, prompts[:4], steps=8, ref_dir=refs["fp8"], quantization="fp8",
                                         same_paths=False, fp8_activations=False)
    print(f"fp8-w8a8: {equal}/{len(prompts)} prompts equal on 32 greedy steps; near-ties {near}; other {other}; "
          f"max logit error {err:.4f} of scale {scale:.2f}; against the weight-only reference {err_w8a8:.4f}, the "
          f"weight-only engine {err_w8:.4f}")
    assert err < W8A8_LOGIT_TOL * scale and err_w8a8 > 2 * err_w8
    assert not other, f"divergences that are not near-ties: {other}"
    assert equal >= 0.75 * len(prompts), f"only {equal}/{len(prompts)} prompts equal"


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("kind", ["gpt2", "qwen3"])
def test_fp8_on_the_unfused_layer(tmp_path, kind, act):
    """GPT-2 and Qwen3 run the unfused layer on the GPU: their FP8 linears go through the split-K kernel and its
    reduce at decode sizes, cuBLAS on the dequantized weight above (act: the norm-fed products, GPT-2's c_attn and
    c_fc, Qwen3's q/k/v and gate/up, on FP8 rows quantized by their own kernel); greedy tokens follow transformers
    BF16 on the dequantized weights (act: those products' inputs rounded to FP8 rows) as the BF16 engine follows
    transformers BF16 (the same near-tie rule)."""
    from tests.decoder_models import build_model
    from tests.gpu.test_decoder_cuda import _compare_greedy, _prompts

    _need("fp8")
    if act:
        _need_fp8_rows()
    d = build_model(kind, tmp_path / kind, seed=4)
    ref = _dequantized_gpt2(d, tmp_path / "ref") if kind == "gpt2" else _dequantized_copy(d, tmp_path / "ref")
    prompts = _prompts(384, 8)
    equal, near, other, err, scale = _compare_greedy(d, prompts, same_paths=False, ref_dir=ref, quantization="fp8",
                                                     fp8_activations=act, ref_patch=fp8_input_rows if act else None)
    print(f"{kind} fp8 (act {act}): {equal}/{len(prompts)} equal; near-ties {near}; other {other}; "
          f"err {err:.4f} of {scale:.2f}")
    assert err < (W8A8_LOGIT_TOL if act else 0.05) * scale
    assert not other, f"divergences that are not near-ties: {other}"


def _dequantized_gpt2(d, out):
    """GPT-2's Conv1D weights are [in, out]: the engine's rows are their columns."""
    from transformers import AutoModelForCausalLM

    from surge.models.weight_quant import dequantize, quantize

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        for block in model.transformer.h:
            for conv in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
                w = conv.weight.t().to(torch.bfloat16)
                conv.weight.copy_(dequantize(*quantize(w), torch.float32).t())
    model.save_pretrained(out, safe_serialization=True)
    return out


QUANT_PARAMS = {"weight_scale", "weight_zero_point", "weight_g_idx", "input_scale", "input_zero_point",
                "weight_global_scale", "input_global_scale", "output_scale"}


@pytest.mark.parametrize("scheme,kind", [("FP8_DYNAMIC", "fp8"), ("W8A8", "int8")])
def test_a_quantized_checkpoint_runs_its_own_weights_on_the_gpu(trained_q8, tmp_path, scheme, kind):
    """A compressed-tensors FP8_DYNAMIC / W8A8 checkpoint (written by its library) on a GPU that runs its kind: the
    layers' weights are the checkpoint's 8-bit bytes (no dequantization, no second rounding), the engine reports
    the kind with no setting asked, and greedy tokens follow transformers on the weights compressed-tensors
    dequantizes, as above."""
    pytest.importorskip("compressed_tensors")  # writes the checkpoint (a GPU machine may lack it: carry its wheel)
    from transformers import AutoModelForCausalLM

    from surge.engines.decoder import DecoderEngine
    from surge.models.weight_quant import KINDS as DTYPES
    from tests.decoder_models import build_quantized_checkpoint, load_quantized_reference
    from tests.gpu.test_decoder_cuda import _compare_greedy, _prompts

    _need(kind)
    d, _ = trained_q8
    ckpt = build_quantized_checkpoint(d, tmp_path / "ct", scheme)
    e = DecoderEngine(ckpt, device="cuda", dtype="bf16", num_blocks=64, max_num_seqs=4, max_model_len=512,
                      cuda_graphs=False, fp8_activations=False)
    assert e.capabilities.quantization == kind == e.model.quantization
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as fh:
        down = fh.get_tensor("model.layers.1.mlp.down_proj.weight")
    assert e.model.w["l1.down"].dtype == DTYPES[kind]
    assert torch.equal(e.model.w["l1.down"].cpu().view(torch.uint8), down.view(torch.uint8))
    del e
    dense = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # the full-precision model's config
    missing, unexpected = dense.load_state_dict(load_quantized_reference(ckpt).state_dict(), strict=False)
    # some transformers versions keep the dequantized modules' quantization parameters (weight_scale, ...)
    assert not missing and all(k.rsplit(".", 1)[-1] in QUANT_PARAMS for k in unexpected), unexpected[:4]
    dense.save_pretrained(tmp_path / "dense", safe_serialization=True)
    prompts = _prompts(384, 16)
    equal, near, other, err, scale = _compare_greedy(ckpt, prompts, ref_dir=tmp_path / "dense", pdl=True,
                                                     fp8_activations=False)
    print(f"{scheme} checkpoint: {equal}/{len(prompts)} equal; near-ties {near}; other {other}; err {err:.4f} of {scale:.2f}")
    assert err < 0.05 * scale
    assert not other, f"divergences that are not near-ties: {other}"
    assert equal >= 0.75 * len(prompts)

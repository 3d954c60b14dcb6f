"""8-bit weights (models/weight_quant.py): the quantizer against a float64 search of the format's codes (E4M3's 256,
INT8's -127..127), the loader's 8-bit form of a checkpoint, and the settings that ask for it (refused where the
device cannot run it). The kernels and the engine on 8-bit weights: tests/gpu/test_fp8_cuda.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from surge.models.weight_quant import (FP8, FP8_MAX, INT8_MAX, SCALE_SUFFIX, dequantize, quantize,  # noqa: E402
                                      quantize_linears)

TOP = {"fp8": FP8_MAX, "int8": INT8_MAX}


def _codes(kind: str) -> torch.Tensor:
    """Every finite value of the format, float64, sorted (E4M3's two NaN codes left out; INT8 symmetric)."""
    if kind == "int8":
        return torch.arange(-127, 128, dtype=torch.float64)
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).double()
    return torch.unique(v[torch.isfinite(v)])


def _weights(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(37, 300, generator=g, dtype=torch.float64)
    w *= torch.logspace(-6, 3, 37, dtype=torch.float64)[:, None]  # rows of very different ranges
    w[5, ::7] *= 50  # outliers: the rest of their row lands in E4M3's subnormals
    w[9] = 0.0  # a row of zeros
    return w.float()


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_element_is_the_nearest_code_of_its_row_scaled(seed, kind):
    w = _weights(seed)
    q, scale = quantize(w, kind)
    top = TOP[kind]
    assert q.dtype == {"fp8": FP8, "int8": torch.int8}[kind] and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (37,)
    amax = w.double().abs().amax(1)
    live = amax > 0
    # the scale maps each row's largest magnitude to the format's largest value (one FP32 rounding)
    assert torch.allclose(scale.double()[live], amax[live] / top, rtol=2 ** -23, atol=0)
    assert scale[9] == 1.0 and (q[9].double() == 0).all()
    assert (q.double().abs().amax(1)[live] == top).all()
    # nearest: no other code is closer to the scaled value (ties either way)
    scaled = (w / scale[:, None]).double().clamp(-top, top)
    best = (scaled[..., None] - _codes(kind)).abs().amin(-1)
    assert torch.equal((scaled - q.double()).abs(), best)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_rows_are_the_nearest_codes_of_each_row_scaled(dtype):
    """quantize_rows (FP8 activation rows for a W8A8 product; the GPU kernels equal it bit for bit): each row's
    scale its largest magnitude / 448 (at least 1e-12 / 448: a row of zeros keeps codes 0), its largest element
    the code 448, every other element the nearest E4M3 code (ties to even) of x * (448 / amax) computed in FP32
    with IEEE divisions; a row's codes do not depend on the other rows."""
    from surge.models.weight_quant import quantize_rows

    x = _weights(5).to(dtype)
    # row 0 at amax 448 (its scale 1): 8.5, 17 and 19 sit halfway between codes (8 | 9, 16 | 18, 18 | 20)
    x[0, :4] = torch.tensor([448.0, 8.5, 17.0, -19.0])
    q, scale = quantize_rows(x)
    assert q[0, :4].float().tolist() == [448.0, 8.0, 16.0, -20.0]  # ties to the even code
    assert q.dtype == FP8 and q.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (37, 1)
    xf = x.float()
    amax = xf.abs().amax(1, keepdim=True)
    live = amax[:, 0] > 0
    assert torch.equal(scale[live], amax[live] / torch.tensor(FP8_MAX))
    assert scale[9, 0] == torch.tensor(1e-12, dtype=torch.float32) / FP8_MAX and not q[9].double().any()
    assert (q.double().abs().amax(1)[live] == FP8_MAX).all()
    inv = torch.tensor(FP8_MAX, dtype=torch.float32) / amax.clamp_min(1e-12)  # one IEEE division a row
    scaled = (xf * inv).double().clamp(-FP8_MAX, FP8_MAX)
    dist = (scaled[..., None] - _codes("fp8")).abs()
    assert torch.equal((scaled - q.double()).abs(), dist.amin(-1))
    ties = (dist == dist.amin(-1, keepdim=True)).sum(-1) > 1  # equidistant: the even code (mantissa bit 0 clear)
    assert ties.sum() >= 3 and (q.view(torch.uint8)[ties] & 1 == 0).all()
    q3, s3 = quantize_rows(x[3:4])
    assert torch.equal(q3.view(torch.uint8), q[3:4].view(torch.uint8)) and torch.equal(s3, scale[3:4])


def test_dequantized_weights_are_within_the_formats_rounding_of_the_originals():
    """E4M3: half a step of a 3-bit mantissa (1/16 relative) for normal values, half the subnormal step (2^-10 of
    the scale) below them. INT8: half a step of the row's uniform grid (half its scale) anywhere."""
    w = _weights(3)
    q, scale = quantize(w, "fp8")
    err = (dequantize(q, scale, torch.float64) - w.double()).abs()
    bound = w.double().abs() * 2.0 ** -4 + scale.double()[:, None] * 2.0 ** -10
    assert (err <= bound * (1 + 1e-6)).all()
    q, scale = quantize(w, "int8")
    err = (dequantize(q, scale, torch.float64) - w.double()).abs()
    assert (err <= scale.double()[:, None] * 0.5 * (1 + 1e-6)).all()
    assert dequantize(q, scale, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize(torch.randn(4))
    with pytest.raises(ValueError, match="kind"):
        quantize(w, "int4")


def test_quantize_linears_swaps_the_named_weights_only():
    g = torch.Generator().manual_seed(4)
    weights = {"l0.qkv": torch.randn(12, 8, generator=g), "l0.attn_norm": torch.randn(8, generator=g)}
    norm = weights["l0.attn_norm"].clone()
    q, s = quantize(weights["l0.qkv"])
    quantize_linears(weights, ["l0.qkv"])
    assert torch.equal(weights["l0.qkv"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(weights["l0.qkv" + SCALE_SUFFIX], s)
    assert torch.equal(weights["l0.attn_norm"], norm) and len(weights) == 3


@pytest.mark.parametrize("quant", ["fp8", "int8"])
@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_the_loader_quantizes_the_layers_linear_weights(tmp_path, kind, quant):
    """load_decoder_weights(quantize=...): each layer's linear weight is the 8-bit form of the one the plain loader
    gives (in the served dtype), with its scales; everything else (embedding, norms, biases, LM head) is the
    plain loader's, bit for bit."""
    from surge.models.decoder import is_layer_linear, load_decoder_config, load_decoder_weights
    from tests.decoder_models import build_model

    d = build_model(kind, tmp_path / kind, seed=5)
    cfg = load_decoder_config(d)
    plain = load_decoder_weights(d, cfg, torch.bfloat16)
    fp8 = load_decoder_weights(d, cfg, torch.bfloat16, quantize=quant)
    linear = [n for n in plain if is_layer_linear(n)]
    assert len(linear) == 4 * cfg.num_layers
    assert set(fp8) == set(plain) | {n + SCALE_SUFFIX for n in linear}
    for name, t in plain.items():
        if name in linear:
            q, s = quantize(t, quant)
            assert fp8[name].dtype == q.dtype and torch.equal(fp8[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(fp8[name + SCALE_SUFFIX], s), name
        else:
            assert fp8[name].dtype == t.dtype and torch.equal(fp8[name], t), name
    assert not is_layer_linear("l0.qkv.bias") and not is_layer_linear("lm_head") and is_layer_linear("l12.down")


def test_fp8_is_refused_where_it_cannot_run(tmp_path):
    """On the CPU (no FP8 kernels) the engine names the setting and what it needs; a model handed FP8 weights on
    the CPU refuses them; the settings accept fp8 and none only, and reach the engine's arguments."""
    from surge.config import GenerationConfig
    from surge.engines.decoder import DecoderEngine
    from surge.engines.decoder.model import DecoderModel
    from surge.errors import ConfigError
    from surge.models.decoder import load_decoder_config, load_decoder_weights
    from surge.runtime.generate_load import decoder_engine_kwargs
    from tests.decoder_models import build_model

    d = build_model("qwen2", tmp_path / "q", seed=6)
    with pytest.raises(ConfigError, match="quantization=fp8 needs a CUDA GPU of compute capability 8.9.*w8a8"):
        DecoderEngine(d, device="cpu", quantization="fp8")
    with pytest.raises(ConfigError, match="quantization=int8 needs a CUDA GPU of compute capability 8.0.*w8a8"):
        DecoderEngine(d, device="cpu", quantization="int8")
    with pytest.raises(ConfigError, match="none, fp8, int8 or w8a8"):
        DecoderEngine(d, device="cpu", quantization="int4")
    cfg = load_decoder_config(d)
    with pytest.raises(ValueError, match="CUDA GPU only"):
        DecoderModel(cfg, load_decoder_weights(d, cfg, torch.float32, quantize="int8"), torch.device("cpu"),
                     torch.float32)
    assert DecoderEngine(d, device="cpu").capabilities.quantization == "none"
    with pytest.raises(ValueError):
        GenerationConfig(quantization="int4")
    for quant in ("fp8", "int8"):
        gen = GenerationConfig.from_sources([f"quantization={quant}"], env={})
        assert gen.quantization == quant
        assert decoder_engine_kwargs(gen.resolved(), "cuda", "bf16")["quantization"] == quant


def test_fp8_activations_is_a_setting_the_engine_gets(tmp_path):
    """GenerationConfig.fp8_activations (default on) reaches DecoderEngine's keyword arguments as set; where there
    are no FP8 weights (a CPU, an unquantized model) it changes nothing: no product takes FP8 rows."""
    from surge.config import GenerationConfig
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_load import decoder_engine_kwargs
    from tests.decoder_models import build_model

    assert GenerationConfig().fp8_activations is True
    for value in (True, False):
        kw = decoder_engine_kwargs(GenerationConfig(fp8_activations=value, quantization="fp8"), "cuda", "bf16")
        assert kw["fp8_activations"] is value and kw["quantization"] == "fp8"
    d = build_model("qwen2", tmp_path / "m", seed=6)
    e = DecoderEngine(d, device="cpu", fp8_activations=True)
    assert not e.model._fp8_act and e.quantization == "none"

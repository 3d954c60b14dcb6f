"""FP8 weights (models/fp8.py): the quantizer against a float64 search of E4M3's 256 codes, the loader's FP8 form
of a checkpoint, and the settings that ask for it (refused where the device cannot run it). The kernels and the
engine on FP8 weights: tests/gpu/test_fp8_cuda.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from surge.models.fp8 import FP8, FP8_MAX, SCALE_SUFFIX, dequantize, quantize, quantize_linears  # noqa: E402


def _codes() -> torch.Tensor:
    """Every finite E4M3 value, float64, sorted (the two NaN codes left out)."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).double()
    return torch.unique(v[torch.isfinite(v)])


def _weights(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(37, 300, generator=g, dtype=torch.float64)
    w *= torch.logspace(-6, 3, 37, dtype=torch.float64)[:, None]  # rows of very different ranges
    w[5, ::7] *= 50  # outliers: the rest of their row lands in E4M3's subnormals
    w[9] = 0.0  # a row of zeros
    return w.float()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_element_is_the_nearest_e4m3_value_of_its_row_scaled(seed):
    w = _weights(seed)
    q, scale = quantize(w)
    assert q.dtype == FP8 and q.shape == w.shape and scale.dtype == torch.float32 and scale.shape == (37,)
    amax = w.double().abs().amax(1)
    live = amax > 0
    # the scale maps each row's largest magnitude to E4M3's largest value (one FP32 rounding)
    assert torch.allclose(scale.double()[live], amax[live] / FP8_MAX, rtol=2 ** -23, atol=0)
    assert scale[9] == 1.0 and (q[9].double() == 0).all()
    assert (q.double().abs().amax(1)[live] == FP8_MAX).all()
    # nearest: no other code is closer to the scaled value (ties either way)
    scaled = (w / scale[:, None]).double().clamp(-FP8_MAX, FP8_MAX)
    codes = _codes()
    best = (scaled[..., None] - codes).abs().amin(-1)
    assert torch.equal((scaled - q.double()).abs(), best)


def test_dequantized_weights_are_within_e4m3s_rounding_of_the_originals():
    """Half a step of a 3-bit mantissa (1/16 relative) for normal values, half the subnormal step (2^-10 of
    the scale) below them."""
    w = _weights(3)
    q, scale = quantize(w)
    err = (dequantize(q, scale, torch.float64) - w.double()).abs()
    bound = w.double().abs() * 2.0 ** -4 + scale.double()[:, None] * 2.0 ** -10
    assert (err <= bound * (1 + 1e-6)).all()
    assert dequantize(q, scale, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantize(torch.randn(4))


def test_quantize_linears_swaps_the_named_weights_only():
    g = torch.Generator().manual_seed(4)
    weights = {"l0.qkv": torch.randn(12, 8, generator=g), "l0.attn_norm": torch.randn(8, generator=g)}
    norm = weights["l0.attn_norm"].clone()
    q, s = quantize(weights["l0.qkv"])
    quantize_linears(weights, ["l0.qkv"])
    assert torch.equal(weights["l0.qkv"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(weights["l0.qkv" + SCALE_SUFFIX], s)
    assert torch.equal(weights["l0.attn_norm"], norm) and len(weights) == 3


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_the_loader_quantizes_the_layers_linear_weights(tmp_path, kind):
    """load_decoder_weights(fp8=True): each layer's linear weight is the FP8 form of the one the plain loader
    gives (in the served dtype), with its scales; everything else (embedding, norms, biases, LM head) is the
    plain loader's, bit for bit."""
    from surge.models.decoder import is_layer_linear, load_decoder_config, load_decoder_weights
    from tests.decoder_models import build_model

    d = build_model(kind, tmp_path / kind, seed=5)
    cfg = load_decoder_config(d)
    plain = load_decoder_weights(d, cfg, torch.bfloat16)
    fp8 = load_decoder_weights(d, cfg, torch.bfloat16, fp8=True)
    linear = [n for n in plain if is_layer_linear(n)]
    assert len(linear) == 4 * cfg.num_layers
    assert set(fp8) == set(plain) | {n + SCALE_SUFFIX for n in linear}
    for name, t in plain.items():
        if name in linear:
            q, s = quantize(t)
            assert fp8[name].dtype == FP8 and torch.equal(fp8[name].view(torch.uint8), q.view(torch.uint8)), name
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
    from surge.runtime.generate_service import decoder_engine_kwargs
    from tests.decoder_models import build_model

    d = build_model("qwen2", tmp_path / "q", seed=6)
    with pytest.raises(ConfigError, match="quantization=fp8 needs a CUDA GPU of compute capability 8.9"):
        DecoderEngine(d, device="cpu", quantization="fp8")
    with pytest.raises(ConfigError, match="none or fp8"):
        DecoderEngine(d, device="cpu", quantization="int4")
    cfg = load_decoder_config(d)
    with pytest.raises(ValueError, match="CUDA GPU only"):
        DecoderModel(cfg, load_decoder_weights(d, cfg, torch.float32, fp8=True), torch.device("cpu"), torch.float32)
    assert DecoderEngine(d, device="cpu").capabilities.quantization == "none"
    with pytest.raises(ValueError):
        GenerationConfig(quantization="int4")
    gen = GenerationConfig.from_sources(["quantization=fp8"], env={})
    assert gen.quantization == "fp8"
    assert decoder_engine_kwargs(gen.resolved(), "cuda", "bf16")["quantization"] == "fp8"

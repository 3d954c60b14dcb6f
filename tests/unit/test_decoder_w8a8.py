"""W8A8 on the CPU (engines/decoder/cpu_w8a8.py, `--generation quantization=w8a8`): the product against a float64
reference of the same rounding, a row's bits independent of its batch, and the engine's greedy tokens against
transformers whose linear layers and LM head compute the W8A8 product in float64."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from surge.engines.decoder import DecoderEngine, cpu_w8a8  # noqa: E402
from surge.models.weight_quant import quantize  # noqa: E402
from tests.unit.test_decoder_engine import KINDS, one_thread  # noqa: E402,F401


def _ref_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-row symmetric INT8 codes and scales of x as cpu_w8a8.quantize_rows documents them, in numpy: computed in
    FP32 (a float64 division would round some quotients near .5 the other way, and one code's step moves a
    product by a visible ~0.5%), as float64 arrays."""
    x32 = x.astype(np.float32)
    amax = np.abs(x32).max(axis=1, keepdims=True)
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return np.clip(np.round(x32 / s), -127, 127).astype(np.float64), s.astype(np.float64)


def _w8a8_float64(x: np.ndarray, w: torch.Tensor, b: np.ndarray | None) -> np.ndarray:
    """The W8A8 product in float64: weight rows quantized by models/weight_quant.quantize (from w's dtype), input
    rows by _ref_rows, the integer sum exact in float64."""
    return _w8a8_codes_float64(x, *quantize(w, "int8"), b)


def _w8a8_codes_float64(x: np.ndarray, q: torch.Tensor, sw: torch.Tensor, b: np.ndarray | None) -> np.ndarray:
    """The W8A8 product in float64 on given weight codes q [N, K] and row scales sw [N]."""
    xq, sx = _ref_rows(x)
    y = (xq @ q.double().numpy().T) * sx * sw.double().reshape(-1).numpy()[None, :]
    return y + b if b is not None else y


def _x(m, k, seed):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitudes, and one of zeros: the per-row scales matter
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]
    x[m // 2] = 0
    return x


@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (7, 768, 2304), (33, 200, 50), (64, 3072, 768)])
def test_the_product_is_the_integer_product_of_the_rounded_rows(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    w = torch.randn(n, k, generator=g) / k ** 0.5 * (torch.rand(n, 1, generator=g) * 4 + 0.1)
    b = torch.randn(n, generator=g)
    x = _x(m, k, n)
    (weight,) = cpu_w8a8.quantize_weights({"w": w}, ["w"]).values()
    xq, sx = cpu_w8a8.quantize_rows(x)
    ref_q, ref_s = _ref_rows(x.double().numpy())
    assert np.array_equal(xq.numpy(), ref_q) and np.array_equal(sx.double().numpy(), ref_s)
    assert xq[m // 2].abs().sum() == 0 and xq.abs().amax(1)[torch.arange(m) != m // 2].eq(127).all()
    y = cpu_w8a8.linear(x, weight, b)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    want = _w8a8_float64(x.double().numpy(), w, b.double().numpy())
    # the codes being the same, the FP32 result is the float64 one rounded a few times
    err = np.abs(y.double().numpy() - want)
    assert (err <= 1e-5 * np.abs(want) + 1e-6 * np.abs(want).max()).all()
    # and the W8A8 rounding itself stays within its budget of the float64 product of the unrounded operands
    full = x.double().numpy() @ w.double().numpy().T + b.double().numpy()
    bound = (np.abs(x.double().numpy()) @ np.abs(w.double().numpy()).T) * (1 / 127)
    assert (np.abs(y.double().numpy() - full) <= bound + 1e-6).all()
    # torch._int_mm's path (where oneDNN's quantized linear is missing): the same up to the scales' FP32 rounding
    assert weight.packed is not None
    plain = cpu_w8a8.linear(x, cpu_w8a8.W8A8Weight(weight.wq_t, weight.sw), b)
    assert torch.allclose(plain, y, rtol=1e-6, atol=1e-6 * y.abs().max().item())
    # BF16 activations and weights: the same product of their codes, rounded once to BF16 at the end
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    bf = cpu_w8a8.linear(xb, cpu_w8a8.quantize_weights({"w": wb}, ["w"])["w"], bb)
    want = _w8a8_float64(xb.double().numpy(), wb, bb.double().numpy())
    assert bf.dtype == torch.bfloat16 and bf.shape == (m, n)
    assert (np.abs(bf.double().numpy() - want) <= 2.0 ** -8 * np.abs(want) + 1e-6 * np.abs(want).max()).all()


def test_a_cpu_whose_products_saturate_is_refused(monkeypatch):
    """An x86 CPU without VNNI / AMX sums u8 x s8 pairs into a saturating int16: the worst case is checked at load
    (here a stand-in for such a kernel, clipping as vpmaddubsw does) and refused with a clear error."""
    from surge.errors import ConfigError

    op, prepack = cpu_w8a8._onednn()

    def saturating(xu, xs, xz, packed, sw, zps, *rest):
        w = packed_codes[id(packed)]
        pairs = xu.long()[:, None, :] * w[None, :, :]  # u8 x s8, then the zero point's share taken off
        pairs = (pairs[..., 0::2] + pairs[..., 1::2]).clamp(-32768, 32767)
        acc = pairs.sum(-1) - xz * w.sum(1)[None, :]
        return (acc.double() * sw.double()).float()

    packed_codes = {}

    def pack(q, shape):
        p = prepack(q, shape)
        packed_codes[id(p)] = q.long()
        return p

    monkeypatch.setattr(cpu_w8a8, "_onednn", lambda: (saturating, pack))
    with pytest.raises(ConfigError, match="not exact"):
        cpu_w8a8.quantize_weights({"w": torch.randn(8, 64)}, ["w"])


def test_a_rows_bits_do_not_depend_on_its_batch():
    w = torch.randn(300, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    weight = cpu_w8a8.quantize_weights({"w": w}, ["w"])["w"]
    x = _x(37, 256, 4)
    x[5] *= 1e4  # a huge neighbour: a per-batch activation scale would crush every other row
    full = cpu_w8a8.linear(x, weight)
    for i in (0, 5, 18, 36):
        assert torch.equal(cpu_w8a8.linear(x[i:i + 1], weight)[0], full[i]), i
    assert torch.equal(cpu_w8a8.linear(x.reshape(37, 1, 256), weight).reshape(37, 300), full)


def _patched_hf(model_dir, name, model=None, codes=None):
    """transformers FP32 (`model`, else loaded from model_dir) with every layer linear (nn.Linear, GPT-2's Conv1D)
    and the LM head computing the W8A8 product in float64 from its FP32 weights, or from `codes` (module name ->
    (q [N, K] INT8, row scales)) where given."""
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    model = model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    codes = codes or {}

    def w8a8(module, w_nk, given):
        bias = None if module.bias is None else module.bias.detach().double().numpy()

        def forward(x):
            flat = x.detach().double().reshape(-1, x.shape[-1]).numpy()
            y = _w8a8_float64(flat, w_nk, bias) if given is None else _w8a8_codes_float64(flat, *given, bias)
            return torch.from_numpy(y).float().reshape(*x.shape[:-1], y.shape[-1])
        return forward

    for mod_name, mod in model.named_modules():
        if isinstance(mod, Conv1D):
            mod.forward = w8a8(mod, mod.weight.detach().t().contiguous(), codes.get(mod_name))
        elif isinstance(mod, torch.nn.Linear):
            mod.forward = w8a8(mod, mod.weight.detach(), codes.get(mod_name))
    return model


def _check_w8a8_greedy(engine, hf_model):
    """test_decoder_engine._check_greedy's run (joins, preemption, prefix hits), compared prompt by prompt: most
    prompts equal transformers' W8A8 tokens on all steps, and one that parts does so where transformers' own top
    two logits are within 1% of the logits' scale. W8A8 is not continuous: an input a last-bit FP32 rounding
    apart (the engine's and transformers' norms round differently) can move one activation code, and one code
    moves a logit by ~0.5%; the codes themselves are checked exactly above."""
    from tests.unit.test_decoder_engine import run_greedy_workload

    n_new = 18
    sched, seqs, prompts = run_greedy_workload(engine, n_new)
    equal, parted = 0, []
    for s, p in zip(seqs, prompts):
        out = hf_model.generate(torch.tensor([p]), max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                                pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        want = out.sequences[0, len(p):].tolist()
        if s.output_ids == want:
            equal += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(s.output_ids, want)) if a != b)
        top = out.scores[j][0].topk(2).values
        parted.append((s.seq_id, j, (top[0] - top[1]).item(), out.scores[j][0].abs().max().item()))
    assert all(gap < 0.01 * scale for _, _, gap, scale in parted), parted
    assert equal >= len(prompts) - 2, parted
    assert sched.preemptions > 0 and sched.blocks.hit_tokens >= 24 and sched.blocks.num_free == 22
    return parted


@pytest.mark.parametrize("name", ["gpt2", "qwen2", "llama", "granite"])
def test_w8a8_engine_greedy_equals_transformers_on_the_same_rounding(name, tmp_path):
    """Sequences joining and leaving the batch, a preempted one, prefix-cache hits: the W8A8 engine's greedy tokens
    are transformers' on the W8A8 products (its weights INT8, a quarter of FP32's bytes), but at near-ties."""
    from tests.decoder_models import build_model

    kind, extra = KINDS[name]
    d = build_model(kind, tmp_path / name, seed=31, **extra)
    engine = DecoderEngine(d, num_blocks=22, block_size=4, quantization="w8a8")
    assert engine.quantization == "w8a8" == engine.capabilities.quantization
    assert engine.model.cpu_layout == {"layers": "w8a8", "lm_head": "w8a8"} and not engine.model._wt
    q = engine.model._w8a8
    assert "lm_head" in q and all(w.wq_t.dtype == torch.int8 and w.packed is not None for w in q.values())
    assert not any(n in engine.model.w for n in q if n != "lm_head")  # the full-precision copies are gone
    print(name, "parted at near-ties:", _check_w8a8_greedy(engine, _patched_hf(d, name)))


def test_a_w8a8_checkpoint_runs_its_own_codes(tmp_path):
    """A compressed-tensors W8A8 checkpoint (INT8 weights by channel, written by its library) with quantization=w8a8:
    the layers' INT8 codes and scales are the checkpoint's bit for bit (compressed-tensors' scale, amax / 127.5 with
    codes down to -128, is not the one re-quantizing its dequantized weights gives), and greedy tokens follow
    transformers on the checkpoint whose every layer linear computes the W8A8 product in float64 on those codes (the
    LM head on its own per-row quantization, as the engine), with joins, preemption and prefix hits."""
    pytest.importorskip("compressed_tensors")
    from safetensors import safe_open

    from tests.decoder_models import build_model, build_quantized_checkpoint, load_quantized_reference

    base = build_model("qwen2", tmp_path / "m", seed=23, hidden_size=256, intermediate_size=512,
                       num_attention_heads=8, num_key_value_heads=2)
    ckpt = build_quantized_checkpoint(base, tmp_path / "ct", "W8A8")
    with safe_open(str(ckpt / "model.safetensors"), "pt") as fh:
        raw = {k: fh.get_tensor(k) for k in fh.keys()}
    engine = DecoderEngine(ckpt, num_blocks=22, block_size=4, quantization="w8a8")
    assert engine.quantization == "w8a8" and not engine.model._scales
    codes, requantized_differs = {}, False
    for i in range(engine.cfg.num_layers):
        for name, parts in (("qkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                            ("o", ["self_attn.o_proj"]), ("up_gate", ["mlp.gate_proj", "mlp.up_proj"]),
                            ("down", ["mlp.down_proj"])):
            mods = [f"model.layers.{i}.{m}" for m in parts]
            for m in mods:
                codes[m] = (raw[m + ".weight"], raw[m + ".weight_scale"].float().reshape(-1))
            w = engine.model._w8a8[f"l{i}.{name}"]
            q = torch.cat([raw[m + ".weight"] for m in mods])
            assert torch.equal(w.wq_t.t(), q) and torch.equal(w.sw, torch.cat([codes[m][1] for m in mods]))
            dq = q.float() * w.sw[:, None]
            requantized_differs |= not torch.equal(quantize(dq, "int8")[0], q)
    assert requantized_differs  # else this test could not tell the codes kept from codes re-made
    print("parted at near-ties:", _check_w8a8_greedy(engine, _patched_hf(None, "qwen2", load_quantized_reference(ckpt),
                                                                           codes)))


def test_w8a8_refuses_what_it_cannot_run(tmp_path):
    from surge.config import GenerationConfig
    from surge.errors import ConfigError
    from tests.decoder_models import build_model

    d = build_model("qwen2", tmp_path / "q", seed=1)
    with pytest.raises(ConfigError, match="FP32 or BF16"):
        DecoderEngine(d, num_blocks=8, block_size=4, quantization="w8a8", dtype="fp16")
    with pytest.raises(ConfigError, match="none, fp8, int8 or w8a8"):
        DecoderEngine(d, num_blocks=8, block_size=4, quantization="int4")
    with pytest.raises(ValueError, match="CPU only"):
        from surge.engines.decoder.model import DecoderModel
        from surge.models.decoder import load_decoder_config

        DecoderModel(load_decoder_config(d), {}, torch.device("meta"), torch.float32, cpu_w8a8=True)
    assert GenerationConfig(quantization="w8a8").quantization == "w8a8"
    bf16 = DecoderEngine(d, num_blocks=8, block_size=4, quantization="w8a8", dtype="bf16")
    assert bf16.quantization == "w8a8" and bf16.model.dtype == torch.bfloat16


def test_without_onednns_op_the_products_run_on_int_mm(monkeypatch):
    """Where oneDNN's quantized linear is missing (or refuses the probe's arguments), weights are not packed and
    torch._int_mm computes the same products."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(8))
    x = _x(5, 96, 9)
    packed = cpu_w8a8.quantize_weights({"w": w}, ["w"])["w"]
    want = cpu_w8a8.linear(x, packed)
    cpu_w8a8._onednn.cache_clear()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    try:
        plain = cpu_w8a8.quantize_weights({"w": w}, ["w"])["w"]
        assert plain.packed is None and packed.packed is not None
        y = cpu_w8a8.linear(x, plain)
        assert torch.allclose(y, want, rtol=1e-6, atol=1e-6 * y.abs().max().item())
    finally:
        cpu_w8a8._onednn.cache_clear()

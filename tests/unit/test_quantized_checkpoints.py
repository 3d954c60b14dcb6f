"""Quantized checkpoints written by their ecosystems' own tools (compressed-tensors' FP8 / FP8_DYNAMIC, W4A16 and
W8A8 schemes; the "fp8" method in 128 x 128 blocks by transformers' FP8 conversion) served by the CPU engine
(dequantized at load, compressed-tensors' integer schemes by its own decompressors): greedy tokens equal
transformers' on the same checkpoint (dequantized by the format's own library) token for token; the FP8 form kept
for the GPU's kernels bit for bit the checkpoint's; other quantizations refused by name."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from surge.engines.decoder import DecoderEngine  # noqa: E402
from surge.errors import ConfigError  # noqa: E402
from surge.runtime.scheduler import SamplingParams, Scheduler, SchedulerConfig, Sequence  # noqa: E402
from tests.decoder_models import build_quantized_checkpoint, build_model, load_quantized_reference  # noqa: E402
# one_thread: the engine tests' module fixture (autouse), one intra-op thread for these tiny models
from tests.unit.test_decoder_engine import drive, hf_greedy, one_thread, prompts_for  # noqa: E402, F401

SCHEMES = ["FP8_DYNAMIC", "FP8", "block", "W4A16", "W8A8"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Qwen2-shaped (GQA, q/k/v biases, tied embeddings) and a Llama-shaped model, hidden 256 and FFN 512 (the
    block format's 128 x 128 tiles divide them), each written in every scheme."""
    root = tmp_path_factory.mktemp("quantized_checkpoints")
    out = {}
    for kind in ("qwen2", "llama"):
        base = build_model(kind, root / kind, seed=21, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                           num_key_value_heads=2)
        for scheme in SCHEMES:
            out[kind, scheme] = build_quantized_checkpoint(base, root / f"{kind}-{scheme}", scheme)
    return out


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_checkpoint_serves_as_transformers_runs_it(checkpoints, kind, scheme):
    """Sequences joining and leaving a running batch, a prefix-cache hit, preemption: every greedy token equals
    transformers' on the checkpoint it dequantizes itself; the prefill's logits within FP32 rounding of its."""
    from surge.engines.decoder.attention import AttnMeta

    d = checkpoints[kind, scheme]
    ref = load_quantized_reference(d)
    engine = DecoderEngine(d, num_blocks=22, block_size=4)
    assert engine.capabilities.quantization == "none"  # the CPU serves the dequantized weights
    assert all(t.dtype == torch.float32 for t in engine.model.w.values())
    sched = Scheduler(SchedulerConfig(num_blocks=22, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=256), engine.cfg.eos_token_ids)
    prompts = prompts_for(engine.cfg.vocab_size, 3)
    seqs = [Sequence(i, p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    drive(engine, sched, seqs, [0, 0, 0, 3, 5, 9, 0, 30, 31])
    for s, p in zip(seqs, prompts):
        assert s.output_ids == hf_greedy(ref, p, 12), f"prompt {s.seq_id} of {len(p)} tokens"
    assert sched.preemptions > 0 and sched.blocks.hit_tokens >= 12
    p = prompts[3]
    n = len(p)
    fresh = DecoderEngine(d, num_blocks=22, block_size=4)
    nb = -(-n // 4)
    meta = AttnMeta(torch.arange(n), torch.arange(nb, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32),
                    torch.tensor([0, n], dtype=torch.int32), n, [n], [n], [list(range(nb))])
    with torch.no_grad():
        ours = fresh.model.logits(fresh.model.forward(torch.tensor(p), torch.arange(n), fresh.kv, meta))
        want = ref(torch.tensor([p])).logits[0]
    assert (ours - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_the_wrong_dequantization_would_be_caught(checkpoints):
    """The reference can tell: compressed-tensors multiplies in the scale's dtype (BF16 here); the same weights
    multiplied in FP32 move the logits by far more than the tolerance above."""
    from safetensors import safe_open

    from surge.models.quantized_checkpoint import CheckpointQuant, dequantize

    d = checkpoints["qwen2", "FP8_DYNAMIC"]
    with safe_open(str(d / "model.safetensors"), "pt") as fh:
        q, s = fh.get_tensor("model.layers.0.mlp.up_proj.weight"), fh.get_tensor("model.layers.0.mlp.up_proj.weight_scale")
    assert s.dtype == torch.bfloat16 and s.shape == (512, 1)
    ours = dequantize(q, s, CheckpointQuant("compressed-tensors"), torch.float32)
    lib = load_quantized_reference(d).model.layers[0].mlp.up_proj.weight
    assert torch.equal(ours, lib)
    assert not torch.equal(q.float() * s.float(), lib)


@pytest.mark.parametrize("scheme", ["FP8_DYNAMIC", "FP8", "W8A8"])
def test_the_gpu_form_keeps_the_checkpoints_bits(checkpoints, scheme):
    """With keep (a GPU whose kernels run FP8 and INT8) the layers' 8-bit linear weights stay as they are, stacked
    as the engine's fused modules (q/k/v, gate/up), bit for bit the checkpoint's, each row's scale the
    checkpoint's (a per-tensor one repeated); the rest as the dequantizing loader gives it; where the kernels run
    FP8 only, INT8 weights are dequantized."""
    from safetensors import safe_open

    from surge.models.decoder import is_layer_linear, load_decoder_config, load_decoder_weights
    from surge.models.weight_quant import FP8, SCALE_SUFFIX

    d = checkpoints["qwen2", scheme]
    cfg = load_decoder_config(d)
    eight = torch.int8 if scheme == "W8A8" else FP8
    kept = load_decoder_weights(d, cfg, torch.bfloat16, keep=(FP8, torch.int8))
    plain = load_decoder_weights(d, cfg, torch.bfloat16)
    with safe_open(str(d / "model.safetensors"), "pt") as fh:
        raw = {k: fh.get_tensor(k) for k in fh.keys()}
    for i in range(cfg.num_layers):
        for name, parts in (("qkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
                            ("o", ["self_attn.o_proj"]), ("up_gate", ["mlp.gate_proj", "mlp.up_proj"]),
                            ("down", ["mlp.down_proj"])):
            mods = [f"model.layers.{i}.{m}" for m in parts]
            q = kept[f"l{i}.{name}"]
            assert q.dtype == eight
            assert torch.equal(q.view(torch.uint8), torch.cat([raw[m + ".weight"] for m in mods]).view(torch.uint8))
            rows = torch.cat([raw[m + ".weight_scale"].float().reshape(-1).expand(raw[m + ".weight"].shape[0])
                              for m in mods])
            assert torch.equal(kept[f"l{i}.{name}{SCALE_SUFFIX}"], rows)
    assert {n for n in kept if not n.endswith(SCALE_SUFFIX)} == set(plain)
    for n, t in plain.items():
        if not is_layer_linear(n):
            assert torch.equal(kept[n], t), n
    other = (torch.int8,) if eight == FP8 else (FP8,)
    assert not any(n.endswith(SCALE_SUFFIX) for n in load_decoder_weights(d, cfg, torch.bfloat16, keep=other))


def test_block_scales_are_dequantized_even_where_fp8_runs(checkpoints):
    """Block scales are not one a row: the kernels cannot take them, so the weights are dequantized (as on the CPU)."""
    from surge.models.decoder import load_decoder_config, load_decoder_weights

    d = checkpoints["llama", "block"]
    cfg = load_decoder_config(d)
    kept = load_decoder_weights(d, cfg, torch.bfloat16, keep=(torch.float8_e4m3fn, torch.int8))
    assert all(t.dtype == torch.bfloat16 for t in kept.values())
    assert not any(n.endswith(".scale") for n in kept)


def test_other_quantizations_are_refused_by_name(checkpoints, tmp_path):
    import shutil

    from surge.models.quantized_checkpoint import read_format

    def with_config(name, qc):
        d = tmp_path / name
        shutil.copytree(checkpoints["qwen2", "FP8_DYNAMIC"], d)
        cfg = json.loads((d / "config.json").read_text())
        cfg["quantization_config"] = qc
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    gptq = with_config("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128})
    with pytest.raises(ConfigError, match="quantization method 'gptq' is not supported; surge reads compressed-tensors"):
        DecoderEngine(gptq)
    with pytest.raises(ConfigError, match="sparsity"):
        read_format({"quantization_config": {"quant_method": "compressed-tensors",
                                             "sparsity_config": {"format": "sparse-24-bitmask"}}})
    assert read_format({}) is None
    assert read_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}).block == (128, 64)


def test_compressed_tensors_is_needed_only_for_the_schemes_it_decompresses(checkpoints, monkeypatch, caplog):
    """FP8 by channel is read by surge alone; W4A16 is decompressed by compressed-tensors (said in the log), and
    without the package the error says what to install."""
    import sys

    DecoderEngine(checkpoints["llama", "W4A16"])
    assert "decompressed at load: served in full precision" in caplog.text
    for mod in [m for m in sys.modules if m == "compressed_tensors" or m.startswith("compressed_tensors.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # import fails
    DecoderEngine(checkpoints["llama", "FP8_DYNAMIC"])
    with pytest.raises(ConfigError, match="pip install compressed-tensors"):
        DecoderEngine(checkpoints["llama", "W4A16"])


def test_granites_residual_multiplier_folds_into_kept_scales(tmp_path):
    """Granite folds its residual multiplier into o and down at load; a kept 8-bit o / down takes it in its row
    scales instead (its bytes stay the checkpoint's), so it stands for what the dequantizing loader gives."""
    from surge.models.decoder import load_decoder_config, load_decoder_weights
    from surge.models.weight_quant import FP8, SCALE_SUFFIX, dequantize

    base = build_model("granite", tmp_path / "granite", seed=4, hidden_size=128, intermediate_size=256)
    d = build_quantized_checkpoint(base, tmp_path / "granite-fp8", "FP8_DYNAMIC")
    cfg = load_decoder_config(d)
    assert cfg.residual_multiplier != 1.0
    kept = load_decoder_weights(d, cfg, torch.float32, keep=(FP8,))
    plain = load_decoder_weights(d, cfg, torch.float32)
    for name in ("l0.o", "l1.down"):
        assert kept[name].dtype == FP8
        back = dequantize(kept[name], kept[name + SCALE_SUFFIX], torch.float32)
        torch.testing.assert_close(back, plain[name], rtol=2 ** -7, atol=0)  # the checkpoint's BF16 product apart

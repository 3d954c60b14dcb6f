"""Decoder-only (causal LM) Hugging Face directories: GPT-2 and the Llama / Qwen2 / Qwen3 / Mistral family.

`load_decoder_config` reads config.json into one normalized DecoderConfig (the
two families differ in norms, MLP, positions and attention layout; the engine
switches on `arch`), `load_decoder_weights` reads the safetensors into one
naming scheme, so the engine never sees checkpoint names. Anything else that
calls itself a causal LM is refused at startup with the list of what is
supported.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from surge.errors import ConfigError

# model_type -> engine family
SUPPORTED = {"gpt2": "gpt2", "llama": "llama", "qwen2": "llama", "qwen3": "llama", "mistral": "llama",
             "granite": "llama"}
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def is_decoder_config(config: dict) -> bool:
    """A causal-LM config (what issue 17 calls task 'generate')."""
    archs = config.get("architectures") or []
    if any(a.endswith(_CAUSAL_SUFFIXES) for a in archs):
        return True
    return not archs and config.get("model_type") in SUPPORTED


def is_decoder_dir(path: str | Path) -> bool:
    """A causal LM served for generation: a decoder's config, and not a sentence-transformers embedding
    directory built on one (Qwen3-Embedding, e5-mistral: engines/decoder/embedder.py serves those)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return False
    try:
        return is_decoder_config(json.loads(file.read_text())) and not has_st_pooling(path)
    except (OSError, ValueError):
        return False


def is_decoder_encoder_dir(path: str | Path) -> bool:
    """A decoder's layers used as an encoder (engines/decoder/embedder.py): a checkpoint with a
    sentence-transformers pooling module (an embedding model: Qwen3-Embedding) or a sequence-classification
    head (`*ForSequenceClassification`: a classifier, or a reranker such as Qwen3-Reranker's seq-cls form)."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return False
    archs = config.get("architectures") or []
    return config.get("model_type") in SUPPORTED and (
        has_st_pooling(path) or any(a.endswith("ForSequenceClassification") for a in archs))


def has_st_pooling(path: str | Path) -> bool:
    """modules.json lists a sentence-transformers Pooling module (the directory pools into embeddings)."""
    try:
        modules = json.loads((Path(path) / "modules.json").read_text())
    except (OSError, ValueError):
        return False
    from surge.models.hf import st_module_class

    return isinstance(modules, list) and any(st_module_class(m) == "Pooling" for m in modules)


@dataclass(frozen=True)
class DecoderConfig:
    arch: str  # "gpt2" | "llama"
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm_eps: float
    qkv_bias: bool
    tie_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    rope: dict = field(default_factory=dict)  # rope_type, rope_theta and the scaling fields
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's query and key, before RoPE
    sliding_window: int | None = None  # Mistral's: a token attends to the last this many
    o_bias: bool = False  # Llama's attention_bias also biases o_proj
    mlp_bias: bool = False  # gate, up and down biased (Llama's / Granite's mlp_bias)
    # Granite's multipliers, folded into the weights at load (load_decoder_weights) but the attention's
    # scale, which replaces 1/sqrt(head_dim)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_scale: float | None = None

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def context_limit(self) -> int:
        """The longest prompt + output the engine serves exactly: the positions, and a sliding window
        (which the engine does not implement) bounds it, since within it every token attends to all before."""
        return min(self.max_positions, self.sliding_window or self.max_positions)


def _rope_params(cfg: dict) -> dict:
    # transformers >= 5 writes `rope_parameters`; older configs have rope_theta + rope_scaling.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    params.setdefault("rope_theta", float(cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = kind
    if kind not in ("default", "linear", "dynamic", "llama3", "yarn"):
        raise ConfigError(f"rope scaling type {kind!r} is not supported (default, linear, dynamic, llama3, yarn)")
    params["partial_rotary_factor"] = float(cfg.get("partial_rotary_factor", 1.0))
    return params


def _ids(value, where: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else ([] if value is None else [value])
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{where}: eos_token_id must be a token id or a list of them, not {value!r}")
    return tuple(values)


def _generation_config(path: str | Path) -> dict:
    """The model's generation_config.json ({} without one)."""
    try:
        gen = json.loads((Path(path) / "generation_config.json").read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read generation_config.json ({exc})") from exc
    return gen if isinstance(gen, dict) else {}


def _eos_ids(config_eos, path: Path) -> tuple[int, ...]:
    """config.json's end tokens, then generation_config.json's others: transformers' `generate` stops at
    the latter's (Llama 3 Instruct's <|eot_id|> is only there) and vLLM adds them to the stop tokens."""
    ids = _ids(config_eos, f"{path}/config.json")
    more = _ids(_generation_config(path).get("eos_token_id"), f"{path}/generation_config.json")
    return ids + tuple(t for t in dict.fromkeys(more) if t not in ids)


# transformers' GenerationConfig defaults of the fields a request may leave unset: a generation_config.json
# value other than these is the model's own default (vLLM reads the file's differences from them the same way)
_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def sampling_defaults(path: str | Path) -> dict:
    """The sampling defaults the model's generation_config.json sets (none without the file)."""
    gen = _generation_config(path)
    out = {}
    for name, default in _SAMPLING_DEFAULTS.items():
        value = gen.get(name)
        if value is None or value == default:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}/generation_config.json: {name} must be a number, not {value!r}")
        out[name] = int(value) if name == "top_k" else float(value)
    return out


def checkpoint_architecture(path: str | Path) -> str | None:
    """config.json's first `architectures` entry (e.g. "Qwen2ForCausalLM"), as an encoder's task detection
    reads it; None when the file or the entry is missing."""
    try:
        archs = json.loads((Path(path) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return archs[0] if archs and isinstance(archs[0], str) else None


def load_decoder_config(path: str | Path) -> DecoderConfig:
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read config.json ({exc})") from exc
    model_type = cfg.get("model_type", "")
    if model_type not in SUPPORTED:
        archs = ", ".join(cfg.get("architectures") or [model_type or "?"])
        raise ConfigError(f"{path}: decoder architecture {archs} (model_type {model_type!r}) is not supported; "
                          f"supported: {', '.join(sorted(SUPPORTED))}")
    eos_ids = _eos_ids(cfg.get("eos_token_id"), path)
    if SUPPORTED[model_type] == "gpt2":
        hidden = int(cfg["n_embd"])
        heads = int(cfg["n_head"])
        if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
            raise ConfigError(f"{path}: activation {cfg.get('activation_function')!r} is not supported")
        return DecoderConfig(
            arch="gpt2", model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            num_layers=int(cfg["n_layer"]), num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
            intermediate_size=int(cfg.get("n_inner") or 4 * hidden), max_positions=int(cfg["n_positions"]),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), qkv_bias=True,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"), rope={"activation": cfg.get("activation_function", "gelu_new")})
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{path}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu)")
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{path}: sliding-window attention is not supported")
    # Qwen2 / Qwen3 write a sliding_window they do not use (use_sliding_window false); Mistral's is used
    window = cfg.get("sliding_window") if model_type == "mistral" else None
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    return DecoderConfig(
        arch="llama", model_type=model_type, vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate_size=int(cfg["intermediate_size"]),
        max_positions=int(cfg.get("max_position_embeddings", 2048)), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        # Qwen2 has biases on q/k/v and none elsewhere; Llama and Qwen3 have `attention_bias`.
        qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), eos_token_ids=eos_ids,
        bos_token_id=cfg.get("bos_token_id"), rope=_rope_params(cfg), qk_norm=model_type == "qwen3",
        sliding_window=int(window) if window else None,
        o_bias=model_type != "qwen2" and bool(cfg.get("attention_bias", False)), mlp_bias=bool(cfg.get("mlp_bias")),
        **(_granite(cfg) if model_type == "granite" else {}))


def _granite(cfg: dict) -> dict:
    return {"embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
            "attention_scale": float(cfg.get("attention_multiplier", 1.0))}


def rope_inv_freq(cfg: DecoderConfig):
    """(inv_freq [head_dim/2], attention scaling of cos/sin) as transformers computes them."""
    import torch

    p = cfg.rope
    dim = int(cfg.head_dim * p.get("partial_rotary_factor", 1.0))
    base = float(p["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = p["rope_type"]
    scale = 1.0
    if kind == "linear":
        inv = inv / float(p["factor"])
    elif kind == "llama3":
        factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
        old = float(p["original_max_position_embeddings"])
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        factor = float(p["factor"])
        old = float(p.get("original_max_position_embeddings") or cfg.max_positions)
        if p.get("original_max_position_embeddings") and cfg.max_positions / old != factor:
            factor = cfg.max_positions / old  # transformers' rule when both are given
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")

        def get_mscale(s, m=1.0):
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        att = p.get("attention_factor")
        if att is None:
            att = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) if mscale and mscale_all \
                else get_mscale(factor)
        scale = float(att)
        beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

        def corr_dim(rot):
            return (dim * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(base))

        lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
        if p.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, dim - 1)
        if lo == hi:
            hi += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
        pos = base ** (torch.arange(0, dim, 2).float() / dim)
        inter, extra = 1.0 / (factor * pos), 1.0 / pos
        extra_factor = 1 - ramp
        inv = inter * (1 - extra_factor) + extra * extra_factor
    # "dynamic" (NTK) equals the default within the original context, the only range served here.
    return inv.float(), scale


def _open_safetensors(path: Path):
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: no *.safetensors weights (only safetensors checkpoints are loaded)")
    return files


def _fold_multipliers(out: dict, cfg: DecoderConfig, lm_head) -> bool:
    """Granite's multipliers as weights (in FP32, before the cast): the embedding's into the embedding, the
    residual branches' into o and down (and their biases; an 8-bit weight's into its row scales), 1 / logits_scaling
    into an LM head of its own (a tied one is copied). Returns False: the LM head is no longer the embedding."""
    out["lm_head"] = lm_head.float() / cfg.logits_scaling
    out["embed"] = out["embed"].float() * cfg.embedding_multiplier
    for i in range(cfg.num_layers):
        for name in ("o", "o.bias", "down", "down.bias"):
            key = f"l{i}.{name}"
            if key + ".scale" in out:
                out[key + ".scale"] = out[key + ".scale"] * cfg.residual_multiplier
            elif key in out:
                out[key] = out[key].float() * cfg.residual_multiplier
    return False


# the layers' linear modules under the engine's names (the ones 8-bit quantization takes: models/weight_quant.py)
LINEAR_MODULES = ("qkv", "o", "fc_in", "fc_out", "up_gate", "down")


def load_decoder_weights(path: str | Path, cfg: DecoderConfig, dtype, device="cpu", quantize: str | None = None,
                         keep: tuple = ()) -> dict:
    """Weights under the engine's names: embed, pos_embed, lm_head, final_norm(.bias), and per layer
    `l{i}.` + attn_norm, qkv(.bias), o(.bias), q_norm / k_norm (Qwen3), mlp_norm, up_gate | fc_in,
    down | fc_out (Linear layout [out, in]); q/k/v and gate/up are concatenated so one GEMM computes them.
    quantize ("fp8" / "int8"): the layers' linear weights (LINEAR_MODULES) in `dtype` on `device`, then quantized
    there to 8 bits with per-row scales under name + ".scale" (models/weight_quant.py), one weight at a time. A
    quantized checkpoint (models/quantized_checkpoint.py): its layers' 8-bit linear weights of a dtype in `keep`
    (those the device's kernels run) stay as they are where their scales are per row or per tensor (the scales
    stacked as the weights are); every other quantized weight is dequantized to `dtype` at load."""
    import torch
    from safetensors import safe_open

    from surge.models import quantized_checkpoint
    from surge.models.weight_quant import SCALE_SUFFIX

    path = Path(path)
    raw: dict[str, torch.Tensor] = {}
    for file in _open_safetensors(path):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                raw[key] = fh.get_tensor(key)
    quant = quantized_checkpoint.read_format(json.loads((path / "config.json").read_text()), str(path))
    if quant is not None:  # under the checkpoint's own names (a compressed-tensors group may target them)
        quantized_checkpoint.resolve(raw, quant, lambda n, dt: dt in keep and ".layers." in f".{n}" and n.endswith(
            "_proj.weight"), dtype, str(path))
    raw = {key.removeprefix("model.").removeprefix("transformer."): t for key, t in raw.items()}

    def take(name: str):
        if name not in raw:
            raise ConfigError(f"{path}: weight {name!r} missing from the checkpoint")
        return raw[name]

    def stacked(name: str, parts: list[str]) -> None:
        """out[name]: the checkpoint's weights `parts` stacked by rows (q/k/v, gate/up); kept 8-bit weights with
        their row scales stacked alike (a mix of 8-bit and full-precision parts: all in full precision)."""
        ws = [take(p) for p in parts]
        scales = [raw.get(p + SCALE_SUFFIX) for p in parts]
        if all(sc is not None for sc in scales):
            out[name + SCALE_SUFFIX] = torch.cat(scales) if len(scales) > 1 else scales[0]
        elif any(sc is not None for sc in scales):
            from surge.models.weight_quant import dequantize

            ws = [dequantize(w, sc, dtype) if sc is not None else w for w, sc in zip(ws, scales)]
        out[name] = torch.cat(ws) if len(ws) > 1 else ws[0]

    out: dict[str, torch.Tensor] = {}
    if cfg.arch == "gpt2":
        out["embed"] = take("wte.weight")
        out["pos_embed"] = take("wpe.weight")
        out["final_norm"], out["final_norm.bias"] = take("ln_f.weight"), take("ln_f.bias")
        for i in range(cfg.num_layers):
            p = f"h.{i}."
            # GPT-2's Conv1D stores [in, out]: transpose to Linear's [out, in].
            out[f"l{i}.attn_norm"], out[f"l{i}.attn_norm.bias"] = take(p + "ln_1.weight"), take(p + "ln_1.bias")
            out[f"l{i}.qkv"], out[f"l{i}.qkv.bias"] = take(p + "attn.c_attn.weight").t(), take(p + "attn.c_attn.bias")
            out[f"l{i}.o"], out[f"l{i}.o.bias"] = take(p + "attn.c_proj.weight").t(), take(p + "attn.c_proj.bias")
            out[f"l{i}.mlp_norm"], out[f"l{i}.mlp_norm.bias"] = take(p + "ln_2.weight"), take(p + "ln_2.bias")
            out[f"l{i}.fc_in"], out[f"l{i}.fc_in.bias"] = take(p + "mlp.c_fc.weight").t(), take(p + "mlp.c_fc.bias")
            out[f"l{i}.fc_out"], out[f"l{i}.fc_out.bias"] = take(p + "mlp.c_proj.weight").t(), take(p + "mlp.c_proj.bias")
        lm_head = raw.get("lm_head.weight")
    else:
        out["embed"] = take("embed_tokens.weight")
        out["final_norm"] = take("norm.weight")
        for i in range(cfg.num_layers):
            p = f"layers.{i}."
            out[f"l{i}.attn_norm"] = take(p + "input_layernorm.weight")
            out[f"l{i}.mlp_norm"] = take(p + "post_attention_layernorm.weight")
            stacked(f"l{i}.qkv", [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
            if cfg.qkv_bias:
                out[f"l{i}.qkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            stacked(f"l{i}.o", [p + "self_attn.o_proj.weight"])
            if cfg.o_bias:
                out[f"l{i}.o.bias"] = take(p + "self_attn.o_proj.bias")
            if cfg.mlp_bias:
                out[f"l{i}.up_gate.bias"] = torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
                out[f"l{i}.down.bias"] = take(p + "mlp.down_proj.bias")
            if cfg.qk_norm:
                out[f"l{i}.q_norm"], out[f"l{i}.k_norm"] = take(p + "self_attn.q_norm.weight"), \
                    take(p + "self_attn.k_norm.weight")
            stacked(f"l{i}.up_gate", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])
            stacked(f"l{i}.down", [p + "mlp.down_proj.weight"])
        lm_head = raw.get("lm_head.weight")
    tied = lm_head is None or cfg.tie_embeddings
    if not tied:
        out["lm_head"] = lm_head
    if (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.logits_scaling) != (1.0, 1.0, 1.0):
        tied = _fold_multipliers(out, cfg, lm_head if not tied else out["embed"])
    out = _moved(out, device, dtype, quantize)
    if tied:
        out["lm_head"] = out["embed"]  # one copy in memory
    return out


def is_layer_linear(name: str) -> bool:
    """Whether a weights-dict name is a layer's linear weight ("l3.qkv"; not its bias or scale)."""
    layer, _, module = name.partition(".")
    return layer[:1] == "l" and layer[1:].isdigit() and module in LINEAR_MODULES


def _moved(raw: dict, device, dtype, quantize: str | None) -> dict:
    """raw's tensors on the device in `dtype`, one at a time; 8-bit weights and their FP32 scales keep their
    dtypes; with `quantize` ("fp8" / "int8") the layers' full-precision linear weights are then quantized there."""
    from surge.models.weight_quant import SCALE_SUFFIX, WEIGHT_DTYPES, quantize_linears

    out = {}
    for name in list(raw):
        t = raw.pop(name)
        if t.dtype in WEIGHT_DTYPES or name.endswith(SCALE_SUFFIX):
            out[name] = t.to(device=device).contiguous()
            continue
        out[name] = t.to(device=device, dtype=dtype).contiguous()
        if quantize and is_layer_linear(name):
            quantize_linears(out, (name,), quantize)
    return out

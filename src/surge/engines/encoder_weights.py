"""Hugging Face BERT-family weights -> surge's encoder layout.

This is the ONE place that knows HF parameter names. Everything downstream
(the encoder math, a later tensor-parallel variant) sees `EncoderWeights`:
per layer a fused QKV matrix [3*hidden, hidden] (rows: all Q heads, then K,
then V) so one GEMM produces the three projections, and plain tensors for the
rest. A tensor-parallel split takes rows of wqkv per head block and columns of
w1 / rows of w2 per FFN slice (see `shard_layer`).

Supported: BERT (and MiniLM, which is a BERT), RoBERTa, XLM-RoBERTa, DistilBERT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from surge.errors import ConfigError

_BERT_LIKE = {"bert", "roberta", "xlm-roberta", "camembert", "minilm"}


@dataclass(frozen=True)
class EncoderConfig:
    model_type: str
    hidden: int
    heads: int
    layers: int
    intermediate: int
    vocab: int
    max_positions: int
    type_vocab: int  # 0: the model has no token-type embedding (DistilBERT)
    eps: float
    activation: str  # "gelu" (erf) or "gelu_tanh"
    position_offset: int  # RoBERTa numbers positions from padding_idx + 1

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def max_length(self) -> int:
        return self.max_positions - self.position_offset


def read_config(path: Path) -> EncoderConfig:
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config.json ({exc})") from exc
    mt = cfg.get("model_type", "bert")
    if mt == "distilbert":
        return EncoderConfig(mt, cfg["dim"], cfg["n_heads"], cfg["n_layers"], cfg["hidden_dim"], cfg["vocab_size"],
                             cfg.get("max_position_embeddings", 512), 0, 1e-12,
                             _activation(cfg.get("activation", "gelu")), 0)
    if mt not in _BERT_LIKE:
        raise ConfigError(f"{path}: model_type {mt!r} is not a BERT-family encoder the torch engine supports")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError(f"{path}: only absolute position embeddings are supported")
    offset = cfg.get("pad_token_id", 1) + 1 if mt in ("roberta", "xlm-roberta", "camembert") else 0
    return EncoderConfig(mt, cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"],
                         cfg["intermediate_size"], cfg["vocab_size"], cfg.get("max_position_embeddings", 512),
                         cfg.get("type_vocab_size", 2), cfg.get("layer_norm_eps", 1e-12),
                         _activation(cfg.get("hidden_act", "gelu")), offset)


def _activation(name: str) -> str:
    if name == "gelu":
        return "gelu"
    if name in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return "gelu_tanh"
    raise ConfigError(f"activation {name!r} is not supported by the torch engine")


@dataclass
class LayerWeights:
    wqkv: torch.Tensor  # [3*heads*head_dim, hidden]
    bqkv: torch.Tensor
    wo: torch.Tensor  # [hidden, heads*head_dim]
    bo: torch.Tensor
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    w1: torch.Tensor  # [ffn, hidden]
    b1: torch.Tensor
    w2: torch.Tensor  # [hidden, ffn]
    b2: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    heads: int  # heads held by this shard (all of them unless tensor-parallel)

    def tensors(self) -> list[torch.Tensor]:
        return [self.wqkv, self.bqkv, self.wo, self.bo, self.ln1_w, self.ln1_b,
                self.w1, self.b1, self.w2, self.b2, self.ln2_w, self.ln2_b]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class EncoderWeights:
    config: EncoderConfig
    word: torch.Tensor
    pos: torch.Tensor
    types: torch.Tensor  # [max(type_vocab,1), hidden]; zeros row when the model has none
    emb_ln_w: torch.Tensor
    emb_ln_b: torch.Tensor
    layers: list[LayerWeights] = field(default_factory=list)

    def embedding_tensors(self) -> list[torch.Tensor]:
        return [self.word, self.pos, self.types, self.emb_ln_w, self.emb_ln_b]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.embedding_tensors()) + sum(l.nbytes() for l in self.layers)

    def to(self, device=None, dtype: torch.dtype | None = None) -> "EncoderWeights":
        def mv(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=device, dtype=dtype).contiguous()

        layers = [LayerWeights(*[mv(t) for t in l.tensors()], heads=l.heads) for l in self.layers]
        return replace(self, word=mv(self.word), pos=mv(self.pos), types=mv(self.types),
                       emb_ln_w=mv(self.emb_ln_w), emb_ln_b=mv(self.emb_ln_b), layers=layers)


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model directory (safetensors preferred, then pytorch_model.bin)."""
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        sd: dict[str, torch.Tensor] = {}
        for f in files:
            sd.update(load_file(str(f)))
        return sd
    binf = path / "pytorch_model.bin"
    if binf.is_file():
        return torch.load(str(binf), map_location="cpu", weights_only=True)
    raise ConfigError(f"{path}: no model.safetensors or pytorch_model.bin")


def _strip_prefix(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix in ("bert.", "roberta.", "distilbert.", "model."):
        if any(k.startswith(prefix + "embeddings.") for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    return sd


def convert(sd: dict[str, torch.Tensor], cfg: EncoderConfig) -> EncoderWeights:
    """HF state dict -> EncoderWeights (float32, CPU)."""
    sd = {k: v.float() for k, v in _strip_prefix(sd).items()}

    def get(name: str) -> torch.Tensor:
        try:
            return sd[name]
        except KeyError:
            raise ConfigError(f"weights lack {name!r} (is this a {cfg.model_type} checkpoint?)") from None

    types = get("embeddings.token_type_embeddings.weight") if cfg.type_vocab else torch.zeros(1, cfg.hidden)
    w = EncoderWeights(cfg, get("embeddings.word_embeddings.weight"), get("embeddings.position_embeddings.weight"),
                       types, get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias"))
    for i in range(cfg.layers):
        if cfg.model_type == "distilbert":
            p = f"transformer.layer.{i}."
            names = ("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin",
                     "sa_layer_norm", "ffn.lin1", "ffn.lin2", "output_layer_norm")
        else:
            p = f"encoder.layer.{i}."
            names = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
                     "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")
        q, k, v, o, ln1, f1, f2, ln2 = (p + n for n in names)
        w.layers.append(LayerWeights(
            wqkv=torch.cat([get(q + ".weight"), get(k + ".weight"), get(v + ".weight")], 0),
            bqkv=torch.cat([get(q + ".bias"), get(k + ".bias"), get(v + ".bias")], 0),
            wo=get(o + ".weight"), bo=get(o + ".bias"),
            ln1_w=get(ln1 + ".weight"), ln1_b=get(ln1 + ".bias"),
            w1=get(f1 + ".weight"), b1=get(f1 + ".bias"), w2=get(f2 + ".weight"), b2=get(f2 + ".bias"),
            ln2_w=get(ln2 + ".weight"), ln2_b=get(ln2 + ".bias"), heads=cfg.heads))
    return w


def load_weights(path: Path) -> EncoderWeights:
    cfg = read_config(path)
    return convert(load_state_dict(path), cfg)


def shard_layer(lw: LayerWeights, head_dim: int, rank: int, world: int) -> LayerWeights:
    """This rank's slice of a layer for tensor parallelism (heads and FFN columns split).

    The partial outputs of wo and w2 must be summed across ranks (all-reduce)
    before the bias and LayerNorm; bo/b2/LN are kept whole on every rank.
    """
    if lw.heads % world or lw.w1.shape[0] % world:
        raise ConfigError(f"{lw.heads} heads / {lw.w1.shape[0]} FFN columns do not split {world} ways")
    hid = lw.heads * head_dim
    hs = hid // world
    rows = slice(rank * hs, (rank + 1) * hs)
    wqkv = torch.cat([lw.wqkv[j * hid:(j + 1) * hid][rows] for j in range(3)], 0)
    bqkv = torch.cat([lw.bqkv[j * hid:(j + 1) * hid][rows] for j in range(3)], 0)
    fs = lw.w1.shape[0] // world
    cols = slice(rank * fs, (rank + 1) * fs)
    return LayerWeights(wqkv, bqkv, lw.wo[:, rows].contiguous(), lw.bo, lw.ln1_w, lw.ln1_b,
                        lw.w1[cols].contiguous(), lw.b1[cols], lw.w2[:, cols].contiguous(), lw.b2,
                        lw.ln2_w, lw.ln2_b, heads=lw.heads // world)

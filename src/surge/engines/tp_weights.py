"""One tensor-parallel rank's weights, built without the full model in one process.

A rank holds every embedding and LayerNorm tensor and the biases of the out- and
FFN-out projections (they are added after the all-reduce), plus its block of
attention heads (rows of the fused QKV, columns of wo) and its slice of FFN
columns (rows of w1, columns of w2) — `encoder_weights.shard_layer`'s split.

Two sources:

* a Hugging Face directory: safetensors are opened lazily and converted one
  layer at a time (through `encoder_weights.convert`, the one place that knows
  HF parameter names), so a process never holds more than one full layer;
* random weights of a given shape (`EncoderConfig`, e.g. `xlmr_xl_config()`),
  generated per head block and per FFN block from seeds that depend on the
  block's global index, not on the world size: rank r of world w holds exactly
  the rows/columns that world 1 (the unsplit model) holds at those indices.
  They are drawn on the rank's device (fast for 3.5B parameters), so the
  numbers depend on the seed and the device type (CPU and CUDA generators differ).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path

import torch

from surge.engines.encoder_weights import (EncoderConfig, EncoderWeights, LayerWeights, convert, load_weights,
                                           read_config, shard_layer)
from surge.errors import ConfigError

_LAYER_KEY = re.compile(r"^(.*?(?:encoder|transformer)\.layer\.)(\d+)\.(.*)$")


def xlmr_xl_config() -> EncoderConfig:
    """XLM-RoBERTa XL's shape (about 3.5B parameters): hidden 2560, 36 layers, 32 heads."""
    return EncoderConfig("xlm-roberta", hidden=2560, heads=32, layers=36, intermediate=10240, vocab=250880,
                         max_positions=514, type_vocab=1, eps=1e-5, activation="gelu", position_offset=2)


def small_config(**kw) -> EncoderConfig:
    """A tiny BERT shape for CPU tests and dry runs."""
    base = dict(model_type="bert", hidden=64, heads=8, layers=2, intermediate=256, vocab=1000, max_positions=128,
                type_vocab=2, eps=1e-12, activation="gelu", position_offset=0)
    base.update(kw)
    return EncoderConfig(**base)


def parameter_count(cfg: EncoderConfig) -> int:
    emb = (cfg.vocab + cfg.max_positions + max(cfg.type_vocab, 1) + 2) * cfg.hidden
    per_layer = 4 * cfg.hidden * cfg.hidden + 4 * cfg.hidden + 2 * cfg.hidden * cfg.intermediate \
        + cfg.intermediate + 5 * cfg.hidden
    return emb + cfg.layers * per_layer


def check_split(cfg: EncoderConfig, world: int) -> None:
    if world < 1 or cfg.heads % world or cfg.intermediate % world:
        raise ConfigError(f"{cfg.heads} heads / {cfg.intermediate} FFN columns do not split {world} ways")


# ---------------------------------------------------------------- from a HF directory

def load_shard(path: Path, rank: int, world: int) -> EncoderWeights:
    """This rank's weights of a HF model directory (float32, CPU)."""
    path = Path(path)
    cfg = read_config(path)
    check_split(cfg, world)
    files = sorted(path.glob("*.safetensors"))
    if not files:  # pytorch_model.bin cannot be read in parts: load, split, drop the rest
        full = load_weights(path)
        return shard_weights(full, rank, world)
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {k: h for h in handles for k in h.keys()}
    by_layer: dict[int, list[str]] = {}
    others = []
    for k in where:
        m = _LAYER_KEY.match(k)
        if m:
            by_layer.setdefault(int(m.group(2)), []).append(k)
        else:
            others.append(k)
    out = convert({k: where[k].get_tensor(k) for k in others}, replace(cfg, layers=0))
    # convert() wants the embeddings to be present; for a layer pass tiny stand-ins do
    stand_ins = {k: torch.zeros(1) for k in others}
    for i in range(cfg.layers):
        sd = dict(stand_ins)
        for k in by_layer.get(i, []):
            m = _LAYER_KEY.match(k)
            sd[f"{m.group(1)}0.{m.group(3)}"] = where[k].get_tensor(k)
        full_layer = convert(sd, replace(cfg, layers=1)).layers[0]
        out.layers.append(_owned(shard_layer(full_layer, cfg.head_dim, rank, world)))
    return out


def _owned(lw: LayerWeights) -> LayerWeights:
    """Copies of a shard's slices, so the full layer they were cut from can be freed."""
    return LayerWeights(*[t.clone() for t in lw.tensors()], heads=lw.heads)


def shard_weights(full: EncoderWeights, rank: int, world: int) -> EncoderWeights:
    check_split(full.config, world)
    layers = [_owned(shard_layer(lw, full.config.head_dim, rank, world)) for lw in full.layers]
    return replace(full, layers=layers)


# ---------------------------------------------------------------- random weights

def _seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


class _Random:
    """Deterministic random tensors keyed by name, generated directly on `device` in `dtype`."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype):
        self.seed, self.device, self.dtype = seed, device, dtype

    def normal(self, shape, *key, std: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        g = torch.Generator(device=self.device).manual_seed(_seed(self.seed, *key))
        t = torch.randn(shape, generator=g, device=self.device, dtype=torch.float32)
        return t.mul_(std).add_(mean).to(self.dtype)


def random_shard(cfg: EncoderConfig, seed: int, rank: int, world: int, device="cpu",
                 dtype: torch.dtype = torch.float32) -> EncoderWeights:
    """This rank's slice of a random model of shape `cfg`; world 1 gives the whole model.

    Head h owns rows [h*d, (h+1)*d) of Q, K and V and those columns of wo; FFN
    block h owns `intermediate / heads` columns. A rank takes heads/world
    consecutive heads and FFN blocks. LayerNorm weights are not 1/0, so that a
    mixed-up tensor changes the output.
    """
    check_split(cfg, world)
    if cfg.intermediate % cfg.heads:
        raise ConfigError("random shards need intermediate_size to be a multiple of the head count")
    device = torch.device(device)
    r = _Random(seed, device, dtype)
    h, d = cfg.hidden, cfg.head_dim
    fb = cfg.intermediate // cfg.heads  # FFN columns per block
    mine = range(rank * cfg.heads // world, (rank + 1) * cfg.heads // world)
    w = EncoderWeights(cfg, r.normal((cfg.vocab, h), "word"), r.normal((cfg.max_positions, h), "pos"),
                       r.normal((max(cfg.type_vocab, 1), h), "types"),
                       r.normal((h,), "emb_ln_w", std=0.1, mean=1.0), r.normal((h,), "emb_ln_b"))
    for i in range(cfg.layers):
        wqkv = torch.cat([r.normal((d, h), i, part, j) for part in "qkv" for j in mine])
        bqkv = torch.cat([r.normal((d,), i, "b" + part, j) for part in "qkv" for j in mine])
        wo = torch.cat([r.normal((h, d), i, "wo", j) for j in mine], 1)
        w1 = torch.cat([r.normal((fb, h), i, "w1", j) for j in mine])
        b1 = torch.cat([r.normal((fb,), i, "b1", j) for j in mine])
        w2 = torch.cat([r.normal((h, fb), i, "w2", j) for j in mine], 1)
        w.layers.append(LayerWeights(
            wqkv, bqkv, wo, r.normal((h,), i, "bo"),
            r.normal((h,), i, "ln1_w", std=0.1, mean=1.0), r.normal((h,), i, "ln1_b"),
            w1, b1, w2, r.normal((h,), i, "b2"),
            r.normal((h,), i, "ln2_w", std=0.1, mean=1.0), r.normal((h,), i, "ln2_b"),
            heads=len(mine)))
    return w


def build_shard(source: "Path | EncoderConfig", rank: int, world: int, device, dtype: torch.dtype,
                seed: int = 0) -> EncoderWeights:
    """A rank's weights on its device: a HF directory's slice, or a random model's."""
    if isinstance(source, EncoderConfig):
        return random_shard(source, seed, rank, world, device, dtype)
    return load_shard(Path(source), rank, world).to(device, dtype)


def source_config(source: "Path | EncoderConfig") -> EncoderConfig:
    return source if isinstance(source, EncoderConfig) else read_config(Path(source))

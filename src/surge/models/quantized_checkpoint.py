"""Quantized checkpoints as others write them: 8-bit weights kept for the GPU's kernels, the rest dequantized.

Two formats carry a decoder's 8-bit linear weights (float8_e4m3fn, or int8) with their scales beside them:

* compressed-tensors (`quant_method: compressed-tensors`): llm-compressor's FP8 and FP8_DYNAMIC schemes
  (`float-quantized`; RedHatAI's "-FP8-dynamic" models) and its symmetric INT8 ones, W8A16 and W8A8
  (`int-quantized`; "-quantized.w8a8"): `<module>.weight_scale`, one a row ([N, 1], strategy "channel") or one a
  tensor ("tensor");
* the "fp8" method (`quant_method: fp8`): one `weight_scale` a tensor (AutoFP8, vLLM), or with `weight_block_size`
  one `weight_scale_inv` a block of the weight (DeepSeek-V3's and Qwen3's "-FP8" models; transformers'
  FineGrainedFP8).

Where the engine runs 8-bit weights of the kind (models/weight_quant.py: a scale per output row; FP8 on a GPU of
compute capability 8.9+, INT8 on 8.0+), a checkpoint whose scales are per row or per tensor keeps its weights as
they are, each row's scale an FP32 number; everywhere else (the CPU, block scales) the weights are dequantized at
load as the format's own library does it (compressed-tensors multiplies in the scale's dtype; transformers' FP8
dequantization in FP32) and served in the model's dtype. Every other compressed-tensors scheme (W4A16 packed
integers from llm-compressor's GPTQ and AWQ, asymmetric integers, NVFP4, FP8 in blocks) is decompressed module by
module by compressed-tensors itself (an optional dependency: `pip install compressed-tensors`) and served in the
model's dtype: the memory of the full-precision model, the checkpoint's rounding.

Activation scales (a static `input_scale`, a dynamic per-token scheme) and KV-cache scales are not used: the
engine multiplies its BF16 activations by the weights, as vLLM runs FP8 checkpoints on GPUs without FP8
arithmetic, so its answers are at least as close to the full-precision model's.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Callable

import torch

from surge.errors import ConfigError
from surge.models.weight_quant import SCALE_SUFFIX, WEIGHT_DTYPES

log = logging.getLogger("surge.models")

SUPPORTED = ("compressed-tensors checkpoints (8-bit FP8 / INT8 weights by channel or tensor run as they are on a "
             "GPU; other schemes decompressed at load), the 'fp8' method (a scale per tensor, or weight_block_size "
             "blocks), or full-precision weights that surge quantizes itself (--generation quantization=fp8|int8)")
# scales the engine does not use (activations, the KV cache), dropped at load
_UNUSED = (".input_scale", ".output_scale", ".input_zero_point", ".output_zero_point", ".weight_zero_point",
           ".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale", ".input_global_scale")


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # "compressed-tensors" or "fp8"
    block: tuple[int, int] | None = None  # the fp8 method's weight_block_size: [rows, columns] a scale
    config: dict | None = None  # compressed-tensors' quantization_config, where compressed-tensors decompresses

    @property
    def per_row(self) -> bool:
        """Whether each 8-bit weight's scales come down to one a row (the engine's kernels take them as they are)."""
        return self.block is None and self.config is None

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.block is not None else "weight_scale"


def read_format(config: dict, where: str = "model") -> CheckpointQuant | None:
    """How a config.json (a dict) says its weights are quantized, None for full-precision weights; a ConfigError
    naming any quantization that cannot be read and what can."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        if qc.get("sparsity_config"):
            raise ConfigError(f"{where}: compressed-tensors sparsity ({qc['sparsity_config'].get('format')}) is not "
                              f"supported; surge reads {SUPPORTED}")
        groups = qc.get("config_groups") or {}
        if not groups:
            raise ConfigError(f"{where}: a compressed-tensors quantization_config without config_groups")
        if all(_by_row(g, qc) for g in groups.values()):
            return CheckpointQuant(method)
        return CheckpointQuant(method, config=qc)
    if method == "fp8":
        if qc.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
            raise ConfigError(f"{where}: FP8 checkpoint of format {qc.get('fmt')!r}: only E4M3 weights are read")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ConfigError(f"{where}: weight_block_size must be [rows, columns], not {block!r}")
        return CheckpointQuant(method, tuple(int(b) for b in block) if block else None)
    raise ConfigError(f"{where}: quantization method {method!r} is not supported; surge reads {SUPPORTED}")


def _by_row(group: dict, qc: dict) -> bool:
    """A compressed-tensors group of symmetric 8-bit weights (float, or int) with one scale a row or a tensor, stored
    as 8-bit tensors (the kernels' form)."""
    w = group.get("weights") or {}
    stored = {"float": ("float-quantized", "naive-quantized"), "int": ("int-quantized", "naive-quantized")}
    return ((group.get("format") or qc.get("format")) in stored.get(w.get("type"), ())
            and w.get("num_bits") == 8 and w.get("strategy") in ("channel", "tensor")
            and w.get("symmetric", True) and not w.get("dynamic"))


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-channel ([N, 1] or [N]) or per-tensor scale as one FP32 scale a row, [N]."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ConfigError(f"a weight of {rows} rows has {s.numel()} scales: not one a row or one a tensor")
    return s.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: CheckpointQuant, dtype: torch.dtype) -> torch.Tensor:
    """An 8-bit weight [N, K] as its format's library dequantizes it, in `dtype`."""
    if fmt.method == "compressed-tensors":  # compressed_tensors' _dequantize: q in the scale's dtype, times it
        s = scale if scale.numel() == 1 else scale.reshape(-1, 1)
        return (q.to(scale.dtype) * s).to(dtype)
    s = scale.float()
    if fmt.block is None or s.numel() == 1:
        return (q.float() * s.reshape(-1, 1) if s.numel() > 1 else q.float() * s).to(dtype)
    n, k = q.shape
    bn, bk = fmt.block
    if s.shape != (-(-n // bn), -(-k // bk)):
        raise ConfigError(f"a [{n}, {k}] weight in {bn} x {bk} blocks has scales {list(s.shape)}")
    grid = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # each element's block's scale
    return (q.float() * grid).to(dtype)


def resolve(raw: dict, fmt: CheckpointQuant, keep: Callable[[str, torch.dtype], bool], dtype: torch.dtype,
            where: str = "model") -> dict:
    """The checkpoint's tensors (name -> tensor, changed in place and returned) with each quantized weight either
    kept in its 8 bits, its scales under `<m>.weight` + SCALE_SUFFIX as one FP32 number a row (a weight with scales
    per row, where `keep(name, its dtype)`), or dequantized to `dtype` (compressed-tensors' other schemes by its
    own decompressors); their scale tensors and the activation / KV-cache scales dropped."""
    if fmt.config is not None:
        _decompress(raw, fmt.config, where)
    for name in [n for n, t in raw.items() if n.endswith(".weight") and t.dtype in WEIGHT_DTYPES]:
        base = name.removesuffix("weight")
        scale = raw.pop(base + fmt.scale_name, None)
        if scale is None:
            raise ConfigError(f"{where}: 8-bit weight {name!r} has no {fmt.scale_name} beside it")
        q = raw[name]
        if q.dim() != 2:
            raise ConfigError(f"{where}: 8-bit weight {name!r} is {q.dim()}-D: only [out, in] linear weights are read")
        if fmt.per_row and keep(name, q.dtype):
            raw[name + SCALE_SUFFIX] = row_scales(scale, q.shape[0])
        else:
            raw[name] = dequantize(q, scale, fmt, dtype)
    for name in [n for n in raw if n.endswith(_UNUSED)]:
        del raw[name]
    stray = [n for n, t in raw.items() if t.dtype in WEIGHT_DTYPES and n + SCALE_SUFFIX not in raw]
    if stray:
        raise ConfigError(f"{where}: 8-bit tensors without weight scales: {stray[:4]}")
    return raw


def _decompress(raw: dict, qc: dict, where: str) -> None:
    """Every quantized module of a compressed-tensors checkpoint decompressed by compressed-tensors' compressor of
    its scheme's format: `<m>.weight` full precision in place of `<m>.weight_packed` / `.weight` and its qparams."""
    try:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError as exc:
        raise ConfigError(f"{where}: its compressed-tensors scheme is decompressed by the compressed-tensors "
                          "package: pip install compressed-tensors") from exc
    cfg = QuantizationConfig.model_validate(qc)
    modules = sorted({n.rsplit(".", 1)[0] for n in raw if n.endswith(".weight_scale")})
    for module in modules:
        scheme = _scheme_of(module, cfg)
        fmt = scheme.format or cfg.format
        prefix = module + "."
        local = {n[len(prefix):]: raw.pop(n) for n in [n for n in raw if n.startswith(prefix) and "." not in
                                                          n[len(prefix):]]}
        dense = BaseCompressor.get_value_from_registry(str(getattr(fmt, "value", fmt))).decompress(local, scheme)
        for key, t in dense.items():
            if key == "weight" or not key.startswith(("weight_", "input_", "output_")):
                raw[prefix + key] = t
    if modules:
        log.warning("%s: %d modules of compressed-tensors format %s decompressed at load: served in full precision",
                    where, len(modules), qc.get("format"))


def _scheme_of(module: str, cfg) -> object:
    """The config group whose targets name the module (a name or `re:` pattern first, then a layer type: every
    module with weight scales here is a linear layer)."""
    by_type = None
    for scheme in cfg.config_groups.values():
        for target in scheme.targets:
            if target.startswith("re:") and re.match(target[3:], module) or target == module:
                return scheme
            if not target.startswith("re:") and "." not in target and target[:1].isupper():
                by_type = by_type or scheme
    if by_type is None:
        raise ConfigError(f"no compressed-tensors config group targets {module!r}")
    return by_type

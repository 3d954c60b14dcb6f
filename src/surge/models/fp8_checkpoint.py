"""FP8 checkpoints as others write them, read into the engine's FP8 form or dequantized.

Two formats carry a decoder's linear weights as float8_e4m3fn with their scales beside them:

* compressed-tensors (`quant_method: compressed-tensors`, `format: float-quantized`): llm-compressor's FP8 and
  FP8_DYNAMIC schemes (RedHatAI's "-FP8-dynamic" models): `<module>.weight_scale`, one a row ([N, 1], strategy
  "channel") or one a tensor ("tensor");
* the "fp8" method (`quant_method: fp8`): one `weight_scale` a tensor (AutoFP8, vLLM), or with `weight_block_size`
  one `weight_scale_inv` a block of the weight (DeepSeek-V3's and Qwen3's "-FP8" models; transformers'
  FineGrainedFP8).

Where the engine runs FP8 weights (models/fp8.py: a scale per output row, a GPU of compute capability 8.9+), a
checkpoint whose scales are per row or per tensor keeps its weights as they are, each row's scale an FP32 number;
everywhere else (the CPU, block scales) the weights are dequantized at load as the format's own library does it
(compressed-tensors multiplies in the scale's dtype; transformers' FP8 dequantization in FP32) and served in the
model's dtype. Activation scales (a static `input_scale`, a dynamic per-token scheme) and KV-cache scales are
not used: the engine multiplies its BF16 activations by the FP8 weights, as vLLM runs these checkpoints on GPUs
without FP8 arithmetic, so its answers are at least as close to the full-precision model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from surge.errors import ConfigError
from surge.models.fp8 import FP8, SCALE_SUFFIX

SUPPORTED = ("compressed-tensors FP8 (float-quantized 8-bit float weights, a scale per channel or per tensor), "
             "the 'fp8' method (a scale per tensor, or weight_block_size blocks), or full-precision weights that "
             "surge quantizes itself (--generation quantization=fp8)")
# scales the engine does not use (activations, the KV cache), dropped at load
_UNUSED = (".input_scale", ".output_scale", ".input_zero_point", ".weight_zero_point", ".k_scale", ".v_scale",
           ".kv_scale", ".q_scale", ".prob_scale")


@dataclass(frozen=True)
class Fp8Format:
    method: str  # "compressed-tensors" or "fp8"
    block: tuple[int, int] | None = None  # the fp8 method's weight_block_size: [rows, columns] a scale

    @property
    def per_row(self) -> bool:
        """Whether each weight's scales come down to one a row (the engine's FP8 kernels take them as they are)."""
        return self.block is None

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.block is not None else "weight_scale"


def read_format(config: dict, where: str = "model") -> Fp8Format | None:
    """The FP8 format of a config.json (a dict), None for full-precision weights; a ConfigError naming any
    other quantization and what is supported."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        _check_compressed_tensors(qc, where)
        return Fp8Format(method)
    if method == "fp8":
        if qc.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
            raise ConfigError(f"{where}: FP8 checkpoint of format {qc.get('fmt')!r}: only E4M3 weights are read")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ConfigError(f"{where}: weight_block_size must be [rows, columns], not {block!r}")
        return Fp8Format(method, tuple(int(b) for b in block) if block else None)
    raise ConfigError(f"{where}: quantization method {method!r} is not supported; surge reads {SUPPORTED}")


def _check_compressed_tensors(qc: dict, where: str) -> None:
    if qc.get("sparsity_config"):
        raise ConfigError(f"{where}: compressed-tensors sparsity ({qc['sparsity_config'].get('format')}) is not "
                          f"supported; surge reads {SUPPORTED}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ConfigError(f"{where}: a compressed-tensors quantization_config without config_groups")
    for name, group in groups.items():
        w = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        ok = (fmt in ("float-quantized", "naive-quantized") and w.get("num_bits") == 8 and w.get("type") == "float"
              and w.get("strategy") in ("channel", "tensor") and w.get("symmetric", True) and not w.get("dynamic"))
        if not ok:
            raise ConfigError(f"{where}: compressed-tensors group {name!r} ({fmt}, weights {w.get('num_bits')}-bit "
                              f"{w.get('type')} by {w.get('strategy')}) is not supported; surge reads {SUPPORTED}")


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A per-channel ([N, 1] or [N]) or per-tensor scale as one FP32 scale a row, [N]."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(rows).contiguous()
    if s.numel() != rows:
        raise ConfigError(f"a weight of {rows} rows has {s.numel()} scales: not one a row or one a tensor")
    return s.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight [N, K] as its format's library dequantizes it, in `dtype`."""
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


def resolve(raw: dict, fmt: Fp8Format, keep: Callable[[str], bool], dtype: torch.dtype) -> dict:
    """The checkpoint's tensors (name -> tensor, changed in place and returned) with each FP8 `<m>.weight`
    either kept as FP8, its scales under `<m>.weight` + SCALE_SUFFIX as one FP32 number a row (where
    `keep(name)` and the format's scales are per row), or dequantized to `dtype`; their scale tensors and the
    activation / KV-cache scales dropped."""
    for name in [n for n, t in raw.items() if n.endswith(".weight") and t.dtype == FP8]:
        base = name.removesuffix("weight")
        scale = raw.pop(base + fmt.scale_name, None)
        if scale is None:
            raise ConfigError(f"FP8 weight {name!r} has no {fmt.scale_name} beside it")
        q = raw[name]
        if q.dim() != 2:
            raise ConfigError(f"FP8 weight {name!r} is {q.dim()}-D: only linear layers' [out, in] weights are read")
        if fmt.per_row and keep(name):
            raw[name + SCALE_SUFFIX] = row_scales(scale, q.shape[0])
        else:
            raw[name] = dequantize(q, scale, fmt, dtype)
    for name in [n for n in raw if n.endswith(_UNUSED)]:
        del raw[name]
    stray = [n for n, t in raw.items() if t.dtype == FP8 and n + SCALE_SUFFIX not in raw]
    if stray:
        raise ConfigError(f"FP8 tensors without weight scales: {stray[:4]}")
    return raw

"""PEFT LoRA adapters of a served decoder, read into the engine's layout.

A LoRA adapter (what `peft` saves: adapter_config.json + adapter_model.safetensors) adds
`scaling * B (A x)` to some of the base model's linear layers. The engine computes the layers'
fused GEMMs (q/k/v as one `qkv`, gate/up as one `up_gate`, models/decoder.py), so an adapter's
per-projection pairs are joined here: the A matrices stacked along the rank, the B matrices placed
block-diagonally into the fused output rows, the scaling (and Granite's residual multiplier) folded
into B. What the engine then adds to a fused layer is exactly the sum of PEFT's per-projection terms.

Refused with a ConfigError naming the reason: other PEFT methods, DoRA, trained biases,
`modules_to_save`, adapters of the embedding or LM head, a layer or shape the base model does not
have (an adapter trained for another model), a rank above the engine slots' (from adapter_config.json
and the safetensors header, before any weight is read), a file that is not a regular file.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from surge.errors import ConfigError
from surge.models.decoder import DecoderConfig

# engine module -> the checkpoint modules it fuses, in output-row order (a dotted name where the last part
# alone is ambiguous: GPT-2's attn.c_proj and mlp.c_proj)
_LLAMA = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "up_gate": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_GPT2 = {"qkv": ("c_attn",), "o": ("attn.c_proj",), "fc_in": ("c_fc",), "fc_out": ("mlp.c_proj",)}
# a PEFT weight's name: the layer, the module's path within it, A or B
_KEY = re.compile(r"^base_model\.model\.(?:model\.|transformer\.)?(?:layers|h)\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def modules_of(cfg: DecoderConfig) -> dict[str, tuple[str, ...]]:
    """The engine modules an adapter of this architecture may change, with their checkpoint parts."""
    return _GPT2 if cfg.arch == "gpt2" else _LLAMA


def part_rows(cfg: DecoderConfig, module: str) -> list[int]:
    """Output rows of each part of an engine module, in the fused weight's order."""
    h, d = cfg.hidden_size, cfg.head_dim
    if cfg.arch == "gpt2":
        return {"qkv": [3 * h], "o": [h], "fc_in": [cfg.intermediate_size], "fc_out": [h]}[module]
    return {"qkv": [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d], "o": [h],
            "up_gate": [cfg.intermediate_size] * 2, "down": [h]}[module]


def in_features(cfg: DecoderConfig, module: str) -> int:
    if module == "o":
        return cfg.hidden_size if cfg.arch == "gpt2" else cfg.num_heads * cfg.head_dim
    if module in ("down", "fc_out"):
        return cfg.intermediate_size
    return cfg.hidden_size


@dataclass
class LoraAdapter:
    """One adapter in the engine's names: (layer, module) -> (A [rank, in], B [out, rank]) in FP32, the
    scaling folded into B; `rank` is the widest part's (what the engine's slots must hold)."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[object, object]] = field(repr=False)


def _alpha_for(module_path: str, config: dict) -> tuple[float, int | None]:
    """(lora_alpha, rank from rank_pattern or None) for a module, PEFT's pattern rule: a key matches a
    module whose dotted path ends with it."""
    alpha = float(config.get("lora_alpha", 8))
    rank = None
    for pattern_key, target in (("alpha_pattern", "alpha"), ("rank_pattern", "rank")):
        for key, value in (config.get(pattern_key) or {}).items():
            if re.match(rf"(.*\.)?({key})$", module_path):
                if target == "alpha":
                    alpha = float(value)
                else:
                    rank = int(value)
                break
    return alpha, rank


def open_regular(file: Path, shown: str, name: str):
    """`file` opened for reading (binary), refused with a ConfigError naming it as `shown` unless it is a
    regular file: reading a FIFO or a device would block (or never end) and hold the adapters' lock.
    Checked before the open (which a FIFO would block, and a device may act on) and again on what was
    opened (non-blocking), so a file swapped in between is refused too. The one place an adapter's file is
    opened: what a caller reads is then what was checked, whatever the path names afterwards."""
    try:
        if not stat.S_ISREG(os.stat(file).st_mode):
            raise ConfigError(f"LoRA adapter '{name}': {shown} is not a regular file")
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:  # strerror, not str(exc): that names the resolved path
        raise ConfigError(f"LoRA adapter '{name}': cannot read {shown} ({exc.strerror or type(exc).__name__})") \
            from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"LoRA adapter '{name}': {shown} is not a regular file")
    return os.fdopen(fd, "rb")


def _safetensors_header(fh, size: int) -> tuple[bytes, dict]:
    """(the bytes read so far, the header's entries) of the safetensors file open as `fh`, `size` bytes long:
    its 8-byte length, then that much JSON (a length past the file's end is refused before it is read)."""
    head = fh.read(8)
    if len(head) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(head, "little")
    if n > size - 8:
        raise ValueError(f"its header length ({n} bytes) runs past the file's end")
    text = fh.read(n)
    header = json.loads(text)  # a ValueError (JSONDecodeError, UnicodeDecodeError) if it is not JSON
    if not isinstance(header, dict) or not all(isinstance(v, dict) for v in header.values()):
        raise ValueError("its header is not a JSON object of tensor entries")
    return head + text, header


def _declared_rank(config: dict, name: str) -> int:
    """The widest rank adapter_config.json declares (`r`, and `rank_pattern`'s per-module ranks)."""
    try:
        return max(int(v) for v in [config.get("r", 8), *(config.get("rank_pattern") or {}).values()])
    except (TypeError, ValueError, AttributeError):
        raise ConfigError(f"LoRA adapter '{name}': adapter_config.json's r or rank_pattern is not an integer") \
            from None


def read_adapter(path: str | Path, cfg: DecoderConfig, name: str | None = None,
                 max_rank: int | None = None, shown: str | None = None) -> LoraAdapter:
    """A PEFT LoRA directory, checked against the base model's config (and a part's rank against
    `max_rank`, the engine slots', before its weights are read), in the engine's layout. `shown`: the
    directory as messages name it (the path a client gave, not where it resolved on the server)."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load as safetensors_load

    path = Path(path)
    name = name or path.name
    shown = shown if shown is not None else str(path)
    config_shown = os.path.join(shown, "adapter_config.json")
    with open_regular(path / "adapter_config.json", config_shown, name) as fh:
        try:
            config = json.loads(fh.read())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"LoRA adapter '{name}': cannot read {config_shown} ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"LoRA adapter '{name}': {config_shown} is not a JSON object")
    kind = str(config.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise ConfigError(f"LoRA adapter '{name}': peft_type {kind} is not supported (LORA)")
    if config.get("use_dora"):
        raise ConfigError(f"LoRA adapter '{name}': DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise ConfigError(f"LoRA adapter '{name}': trained biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise ConfigError(f"LoRA adapter '{name}': modules_to_save ({config['modules_to_save']}) is not supported: "
                          "the adapter replaces whole base weights")
    declared = _declared_rank(config, name)
    if max_rank is not None and declared > max_rank:
        raise ConfigError(f"LoRA adapter '{name}' has rank {declared}, above max_lora_rank {max_rank} "
                          "(adapter_config.json; --generation max_lora_rank=N)")
    file = path / "adapter_model.safetensors"
    file_shown = os.path.join(shown, "adapter_model.safetensors")
    if not os.path.lexists(file):
        raise ConfigError(f"LoRA adapter '{name}': {file_shown} missing (only safetensors adapters are loaded)")
    # Read from the descriptor that was checked (open_regular), never by the path again: a path swapped for a
    # FIFO or another file after the check would otherwise be what is read (and a FIFO's open blocks).
    with open_regular(file, file_shown, name) as fh:
        try:
            size = os.fstat(fh.fileno()).st_size  # read no more than this: a file that keeps growing ends
            head, header = _safetensors_header(fh, size)
            for key in sorted(k for k in header if k != "__metadata__"):  # shapes before any weight is read
                shape = header[key].get("shape") if key.endswith("lora_A.weight") else None
                rank = shape[0] if shape else 0
                if max_rank is not None and isinstance(rank, int) and rank > max_rank:
                    raise ConfigError(f"LoRA adapter '{name}' has rank {rank}, above max_lora_rank {max_rank} "
                                      f"({key}; --generation max_lora_rank=N)")
            raw = safetensors_load(head + fh.read(size - len(head)))  # checks every entry as safe_open does
        except (SafetensorError, OSError, ValueError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ConfigError(f"LoRA adapter '{name}': {file_shown} is not a readable safetensors file ({why})") \
                from None
    modules = modules_of(cfg)
    where = {part: module for module, parts in modules.items() for part in parts}
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None:
            what = "the embedding or LM head" if re.search(r"embed|lm_head|wte|wpe", key) else "an unknown module"
            raise ConfigError(f"LoRA adapter '{name}': weight {key!r} adapts {what}; only the layers' linear "
                              f"projections can be adapted ({', '.join(sorted(where))})")
        layer, module_path, ab = int(m.group(1)), m.group(2), m.group(3)
        part = next((p for p in where if module_path == p or module_path.endswith("." + p)), None)
        if part is None or layer >= cfg.num_layers:
            raise ConfigError(f"LoRA adapter '{name}': {key!r} names no linear layer of this {cfg.model_type} model "
                              f"({cfg.num_layers} layers; adaptable: {', '.join(sorted(where))})")
        found.setdefault((layer, part), {"path": module_path})[ab] = tensor
    if not found:
        raise ConfigError(f"LoRA adapter '{name}': {file_shown} holds no LoRA weights")
    residual = cfg.residual_multiplier  # Granite's, folded into o and down like the base weights
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    widest = 0
    for layer in range(cfg.num_layers):
        for module, parts in modules.items():
            rows = part_rows(cfg, module)
            a_blocks, b_blocks = [], []
            for part, out_rows in zip(parts, rows):
                pair = found.get((layer, part))
                if pair is None:
                    continue
                if "A" not in pair or "B" not in pair:
                    raise ConfigError(f"LoRA adapter '{name}': layer {layer} {part} has lora_A or lora_B only")
                a, b = pair["A"].float(), pair["B"].float()
                r = a.shape[0]
                if a.shape != (r, in_features(cfg, module)) or b.shape != (out_rows, r):
                    raise ConfigError(
                        f"LoRA adapter '{name}': layer {layer} {part} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                        f"the base model needs [r, {in_features(cfg, module)}] and [{out_rows}, r] (an adapter "
                        "of another model?)")
                alpha, _ = _alpha_for(pair["path"], config)
                scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
                if module in ("o", "down") and residual != 1.0:
                    scaling *= residual
                a_blocks.append((parts.index(part), a))
                b_blocks.append((parts.index(part), b * scaling))
            if not a_blocks:
                continue
            rank = sum(a.shape[0] for _, a in a_blocks)
            # B block-diagonal: part j's rows of the fused output take only part j's rank columns
            b_full = torch.zeros(sum(rows), rank)
            offsets = [sum(rows[:j]) for j in range(len(rows))]
            col = 0
            for (j, a), (_, b) in zip(a_blocks, b_blocks):
                b_full[offsets[j]:offsets[j] + rows[j], col:col + a.shape[0]] = b
                col += a.shape[0]
            weights[(layer, module)] = (torch.cat([a for _, a in a_blocks]), b_full)
            widest = max(widest, max(a.shape[0] for _, a in a_blocks))
    if max_rank is not None and widest > max_rank:
        raise ConfigError(f"LoRA adapter '{name}' has rank {widest}, above max_lora_rank {max_rank} "
                          "(--generation max_lora_rank=N)")
    return LoraAdapter(name, widest, weights)

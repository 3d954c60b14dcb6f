"""Which task a model directory serves, decided from its files.

`config.json`'s `architectures` name the head transformers would build:
`*ForSequenceClassification` is a classifier (or, with one label, a
cross-encoder reranker), `*ForTokenClassification` a token tagger, a bare
`*Model` / `*ForMaskedLM` (or any sentence-transformers directory) an
embedding model, and a decoder (`*ForCausalLM`, `*LMHeadModel`) a text
generator (issue 18 serves those). Anything else is refused at startup with
the architecture named and the supported ones listed, never served silently
as an embedding model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from surge.errors import ConfigError
from surge.models.decoder import SUPPORTED as DECODER_TYPES
from surge.models.decoder import has_st_pooling

EMBED, CLASSIFY, RERANK, TOKEN_CLASSIFY, GENERATE = "embed", "classify", "rerank", "token-classify", "generate"
ENCODER_TASKS = (EMBED, CLASSIFY, RERANK, TOKEN_CLASSIFY)
TASKS = ENCODER_TASKS + (GENERATE,)

SUPPORTED_ARCHITECTURES = (
    "BertModel, RobertaModel, XLMRobertaModel, DistilBertModel (and *ForMaskedLM, sentence-transformers "
    "directories): embed; *ForSequenceClassification: classify (rerank with one label or a cross-encoder "
    "config); *ForTokenClassification: token-classify; *ForCausalLM / *LMHeadModel: generate, or embed with "
    "a sentence-transformers pooling config (Qwen3-Embedding, e5-mistral)"
)
# Backbones the engines (ONNX export, torch encoder) run.
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "distilbert", "camembert")
_DECODER_SUFFIXES = ("ForCausalLM", "LMHeadModel")


@dataclass(frozen=True)
class TaskInfo:
    task: str
    architecture: str
    labels: tuple[str, ...] = ()  # id2label in id order (classify, rerank, token-classify)
    multi_label: bool = False  # problem_type multi_label_classification: sigmoid per label
    source: str = "config.json"  # what decided the task (shown in errors and /info)
    extra: dict = field(default_factory=dict, compare=False)


def _labels(config: dict) -> tuple[str, ...]:
    id2label = config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            return tuple(str(id2label[k]) for k in sorted(id2label, key=lambda k: int(k)))
        except (TypeError, ValueError):
            raise ConfigError(f"config.json: id2label keys must be integers, got {sorted(id2label)[:5]}") from None
    n = config.get("num_labels") or 2
    return tuple(f"LABEL_{i}" for i in range(int(n)))


def _is_cross_encoder(path: Path, config: dict) -> bool:
    """sentence-transformers CrossEncoder directories (v3 writes this key into config.json, v4+ a file)."""
    if "sentence_transformers" in config and isinstance(config["sentence_transformers"], dict):
        return True
    st = path / "config_sentence_transformers.json"
    if st.is_file():
        try:
            return json.loads(st.read_text()).get("model_type") == "CrossEncoder"
        except (OSError, ValueError):
            return False
    return False


def detect_task(path: Path, config: dict, override: str | None = None) -> TaskInfo:
    """The task of the model in `path` (config.json already read); `override` wins when given."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else ""
    labels = _labels(config) if arch.endswith(("ForSequenceClassification", "ForTokenClassification")) else ()
    if override is not None:
        return _overridden(path, config, arch, override)
    if arch.endswith("ForSequenceClassification"):
        multi = config.get("problem_type") == "multi_label_classification"
        if len(labels) == 1 or (_is_cross_encoder(path, config) and len(labels) == 1):
            return TaskInfo(RERANK, arch, labels, multi)
        return TaskInfo(CLASSIFY, arch, labels, multi)
    if arch.endswith("ForTokenClassification"):
        return TaskInfo(TOKEN_CLASSIFY, arch, labels)
    if config.get("model_type") in DECODER_TYPES and has_st_pooling(path):
        # a decoder trained for embeddings (Qwen3-Embedding, e5-mistral: `*ForCausalLM` in config.json)
        return TaskInfo(EMBED, arch or "(none)", source="modules.json")
    if arch.endswith(_DECODER_SUFFIXES) or config.get("is_decoder") and not arch.endswith("Model"):
        return TaskInfo(GENERATE, arch)
    if not arch or arch.endswith(("Model", "ForMaskedLM")) or (path / "modules.json").is_file():
        if arch.endswith("Model") and arch[:-5].lower() in ("gpt2", "gptneo", "llama", "mistral", "qwen2", "qwen3",
                                                              "granite", "opt"):
            return TaskInfo(GENERATE, arch)  # a bare decoder backbone
        return TaskInfo(EMBED, arch or "(none)", source="modules.json" if (path / "modules.json").is_file()
                        else "config.json")
    raise ConfigError(f"{path}: architecture {arch} is not one surge can serve; supported: {SUPPORTED_ARCHITECTURES}")


def _overridden(path: Path, config: dict, arch: str, task: str) -> TaskInfo:
    if task not in TASKS:
        raise ConfigError(f"task must be one of {', '.join(TASKS)}, not {task!r}", param="task")
    if task in (CLASSIFY, RERANK, TOKEN_CLASSIFY):
        wanted = "ForTokenClassification" if task == TOKEN_CLASSIFY else "ForSequenceClassification"
        if not arch.endswith(wanted):
            raise ConfigError(f"{path}: task {task} needs a *{wanted} checkpoint (a trained head), "
                              f"but config.json's architecture is {arch or 'not given'}", param="task")
    labels = _labels(config) if task != EMBED and task != GENERATE else ()
    if task == RERANK and len(labels) != 1:
        raise ConfigError(f"{path}: task rerank needs a head with one label (a cross-encoder score), "
                          f"this one has {len(labels)}", param="task")
    return TaskInfo(task, arch or "(none)", labels, config.get("problem_type") == "multi_label_classification",
                    source="override")


def check_servable(task: TaskInfo, model_type: str, path: Path) -> None:
    """Raise a startup error for a model the encoder engines cannot serve."""
    if task.task == GENERATE:
        raise ConfigError(f"{path}: architecture {task.architecture} is a text generator (task generate) that "
                          f"surge's decoder engine does not run (models/decoder.py lists those it does); "
                          f"supported: {SUPPORTED_ARCHITECTURES}", param="task")
    if task.task in (CLASSIFY, RERANK) and model_type in DECODER_TYPES:
        return  # *ForSequenceClassification: the score head on the last real token (engines/heads.py)
    if task.task == TOKEN_CLASSIFY and model_type in DECODER_TYPES:
        raise ConfigError(f"{path}: token classification on a decoder ({task.architecture}) is not supported; "
                          "decoders serve generate, embed (with a sentence-transformers pooling config), classify "
                          "and rerank (*ForSequenceClassification)", param="task")
    if task.task == EMBED and model_type in DECODER_TYPES:
        if not has_st_pooling(path):
            raise ConfigError(f"{path}: task embed on a decoder ({task.architecture}) needs a sentence-transformers "
                              "pooling config (modules.json and its Pooling module's config.json, as "
                              "Qwen3-Embedding ships); without one it is served as a text generator", param="task")
        return
    if model_type not in ENCODER_TYPES:
        raise ConfigError(f"{path}: model_type {model_type!r} ({task.architecture}) is not an encoder surge "
                          f"serves; supported model types: {', '.join(ENCODER_TYPES)}")

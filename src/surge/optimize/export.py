"""Export a Hugging Face encoder to ONNX with the PyTorch exporter.

The graph takes input_ids, attention_mask and token_type_ids ([batch, seq],
both axes dynamic). An embedding model's graph (and the backbone that several
heads share, model.yaml `heads:`) returns last_hidden_state: pooling stays
outside so one artifact serves every pooling mode. A task model's graph
(classify / rerank / token-classify) keeps its head and returns `logits`:
[batch, labels] for sequence heads, [batch, seq, labels] for token heads.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import onnx

from surge.models.hf import ModelSpec
from surge.optimize import artifact as art

EXPORT_VERSION = 1  # bump when the exported graph's contract changes
OPSET = 18


def export_settings(opset: int = OPSET) -> dict:
    # The version from package metadata: importing torch only to key the cache
    # would add seconds to every server start that reuses an artifact.
    from importlib.metadata import PackageNotFoundError, version

    try:
        torch_version = version("torch").split("+")[0]
    except PackageNotFoundError:
        torch_version = "none"
    return {"exporter": "torch.onnx", "opset": opset, "version": EXPORT_VERSION, "torch": torch_version}


TASK_GRAPHS = ("classify", "rerank", "token-classify")
LOGITS = "logits"


def task_graph(spec: ModelSpec, backbone: bool = False) -> bool:
    """Whether `spec` exports as a task graph (its head inside, logits out)."""
    return spec.task in TASK_GRAPHS and not backbone


def load_torch_model(spec: ModelSpec, dtype=None, head: bool = False):
    """The transformers model in eval mode, FP32 unless asked otherwise, eager attention;
    `head`: with the task's head (`*ForSequenceClassification` / `*ForTokenClassification`)."""
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification, AutoModelForTokenClassification

    cls = AutoModel
    if head:
        cls = AutoModelForTokenClassification if spec.task == "token-classify" else AutoModelForSequenceClassification
    model = cls.from_pretrained(
        str(spec.path), dtype=dtype or torch.float32, attn_implementation="eager", local_files_only=True
    )
    return model.eval()


class _Wrapper:
    """Presents the HF model as (ids, mask, types) -> last_hidden_state (or logits, with a head)."""

    @staticmethod
    def build(model, uses_token_types: bool, logits: bool = False):
        import torch

        class Wrapped(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, token_type_ids):
                kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
                if uses_token_types:
                    kwargs["token_type_ids"] = token_type_ids
                out = self.model(**kwargs)
                return out.logits if logits else out.last_hidden_state

        return Wrapped().eval()


def export_onnx(spec: ModelSpec, out_file: Path, opset: int = OPSET, progress=None, backbone: bool = False) -> Path:
    """Write `out_file`; `progress(step: str)` is called as the export advances.
    A task model exports with its head unless `backbone` (several heads share the graph)."""
    say = progress or (lambda step: None)
    say("loading PyTorch weights")
    return export_model(load_torch_model(spec, head=task_graph(spec, backbone)), spec, out_file, opset, progress)


def export_model(model, spec: ModelSpec, out_file: Path, opset: int = OPSET, progress=None) -> Path:
    """Export an already loaded (possibly modified, e.g. pruned) transformers model of `spec`;
    a model with a task head (`model.base_model is not model`) exports its logits."""
    import torch

    say = progress or (lambda step: None)
    uses_types = spec.config.get("type_vocab_size", 0) > 0 and spec.model_type not in ("distilbert",)
    logits = getattr(model, "base_model", model) is not model
    wrapped = _Wrapper.build(model, uses_types, logits)
    out_name = LOGITS if logits else "last_hidden_state"
    # sequence logits [batch, labels]; token logits and hidden states [batch, seq, ...]
    out_axes = {0: "batch"} if logits and spec.task != "token-classify" else {0: "batch", 1: "seq"}
    batch, seq = 2, 16
    ids = torch.randint(1000, spec.vocab_size, (batch, seq), dtype=torch.long)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq // 2 :] = 0
    types = torch.zeros(batch, seq, dtype=torch.long)
    say("tracing and converting to ONNX")
    out_file.parent.mkdir(parents=True, exist_ok=True)
    # The TorchScript exporter is fast and stable for encoder graphs and gives
    # dynamic axes directly; its warnings about tracing are expected here.
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        torch.onnx.export(
            wrapped,
            (ids, mask, types),
            str(out_file),
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=[out_name],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "seq"},
                "attention_mask": {0: "batch", 1: "seq"},
                "token_type_ids": {0: "batch", 1: "seq"},
                out_name: out_axes,
            },
            opset_version=opset,
            do_constant_folding=True,
            dynamo=False,
        )
    say("checking the ONNX graph")
    onnx.checker.check_model(str(out_file))
    return out_file


_HEAD_PREFIXES = ("classifier.", "pre_classifier.", "pooler.", "score.")
_HEAD_CONFIG_KEYS = ("architectures", "id2label", "label2id", "num_labels", "problem_type", "_name_or_path",
                     "transformers_version", "finetuning_task", "sentence_transformers")


def backbone_hash(spec: ModelSpec) -> str | None:
    """A hash of what a task model's backbone graph depends on: the backbone only.

    The backbone graph (several heads on one backbone, run after the engine, engines/heads.py) ends
    at the last hidden state, so task checkpoints trained on one frozen backbone share it. None when
    the weights are not a single safetensors file (the whole directory is hashed then)."""
    import hashlib
    import json

    if spec.task == "embed" or not spec.weights_file.is_file():
        return None
    from safetensors import safe_open

    digest = hashlib.sha256(b"backbone-v1")
    cfg = {k: v for k, v in spec.config.items() if k not in _HEAD_CONFIG_KEYS}
    digest.update(json.dumps(cfg, sort_keys=True).encode())
    digest.update(str(spec.max_length).encode())
    digest.update(spec.tokenizer_file.read_bytes())
    with safe_open(str(spec.weights_file), framework="np") as f:
        names = {}
        for k in f.keys():
            short = k.split(".", 1)[1] if k.split(".", 1)[0] in ("bert", "roberta", "distilbert") else k
            if not short.startswith(_HEAD_PREFIXES) and not k.startswith(_HEAD_PREFIXES):
                names[short] = k
        for short in sorted(names):
            digest.update(short.encode())
            digest.update(f.get_tensor(names[short]).tobytes())
    return digest.hexdigest()


def ensure_exported(spec: ModelSpec, cache_dir: Path, progress=None, backbone: bool = False) -> Path:
    """The artifact for `spec`, exported once and reused from `cache_dir` after.

    A task model's graph keeps its head (logits out) unless `backbone`: the graph several heads
    share (hidden states out). The graph kind is part of the key, so that a task graph, a backbone
    graph and an embedding graph of one model directory (`--task` overrides) never collide."""
    settings = export_settings()
    with_head = task_graph(spec, backbone)
    shared = None if with_head else backbone_hash(spec)
    model_hash = shared or spec.content_hash()
    if with_head:  # the head (and which one: --task may read one directory as another task) is in the graph
        settings = {**settings, "graph": f"{spec.task}-logits", "labels": len(spec.labels)}
    key = art.settings_key(model_hash, settings)
    kind = "backbone" if shared else spec.task if with_head else None
    final = Path(cache_dir) / "artifacts" / (f"{spec.model_type}-backbone-{key}" if shared
                                             else f"{spec.name}-{kind}-{key}" if with_head else f"{spec.name}-{key}")
    if art.is_complete(final):
        return final
    with art.staging_dir(final) as tmp:
        export_onnx(spec, tmp / art.MODEL_FILE, progress=progress, backbone=not with_head)
        graph = onnx.load(str(tmp / art.MODEL_FILE), load_external_data=False)
        art.write_manifest(
            tmp,
            {
                "kind": "export",
                "model_name": spec.name,
                "source": str(spec.path),
                "source_hash": model_hash,
                "settings": settings,
                "precision": "fp32",
                "task": spec.task,
                "outputs": LOGITS if with_head else "hidden",  # logits: the head is inside the graph
                "backbone_shared": bool(shared),
                "nodes": len(graph.graph.node),
                "pooling": spec.pooling,
                "normalize": spec.normalize,
                "max_length": spec.max_length,
                "hidden_size": spec.hidden_size,
                "vocab_size": spec.vocab_size,
                "model_file": art.MODEL_FILE,
            },
        )
    return final

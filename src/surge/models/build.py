"""Task checkpoints built from a backbone: seeded random heads (for equality tests and
benchmarks) and the save step shared with models/finetune.py.

No trained heads ship in a package here, so tests and benchmarks make their
own: transformers' `*ForSequenceClassification` / `*ForTokenClassification`
on the bundled MiniLM (or a random BERT-base config), saved as an ordinary
Hugging Face directory with the backbone's tokenizer files beside it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy(Path(src) / name, Path(dst) / name)


def save_checkpoint(model, backbone_dir: Path, out: Path, extra_config: dict | None = None) -> Path:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    copy_tokenizer(backbone_dir, out)
    if extra_config:
        cfg_file = out / "config.json"
        cfg = json.loads(cfg_file.read_text())
        cfg.update(extra_config)
        cfg_file.write_text(json.dumps(cfg, indent=2))
    return out


def random_head_model(backbone_dir: Path, out: Path, task: str, labels: list[str], seed: int = 0,
                      multi_label: bool = False, head_std: float = 0.5) -> Path:
    """`backbone_dir`'s encoder with a seeded random head of `task` (classify, rerank, token-classify).

    The head's weights are drawn with a larger spread than transformers' init (0.02) so that the
    labels really differ between inputs (an argmax over near-equal logits would test nothing).
    """
    import torch
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    cls = AutoModelForTokenClassification if task == "token-classify" else AutoModelForSequenceClassification
    kwargs = {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
              "label2id": {v: i for i, v in enumerate(labels)}}
    if multi_label:
        kwargs["problem_type"] = "multi_label_classification"
    torch.manual_seed(seed)
    import transformers

    transformers.logging.set_verbosity_error()
    model = cls.from_pretrained(str(backbone_dir), local_files_only=True, **kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("classifier", "pre_classifier")):
                p.copy_(torch.randn(p.shape, generator=g) * (head_std if p.dim() > 1 else 0.1))
    return save_checkpoint(model.eval(), backbone_dir, out)


def random_bert_base(out: Path, tokenizer_dir: Path, task: str = "classify", labels: int = 8,
                     seed: int = 0) -> Path:
    """A BERT-base-sized (12 x 768) checkpoint with random weights (benchmarks), tokenizer from `tokenizer_dir`."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                     intermediate_size=3072, max_position_embeddings=512,
                     num_labels=labels, id2label={i: f"intent_{i}" for i in range(labels)},
                     label2id={f"intent_{i}": i for i in range(labels)})
    model = BertModel(cfg) if task == "embed" else BertForSequenceClassification(cfg)
    return save_checkpoint(model.eval(), tokenizer_dir, out)


def assemble_checkpoint(backbone_dir: Path, head_dir: Path, out: Path, prefix: str = "bert.") -> Path:
    """A task checkpoint from a backbone directory and a head directory (its config.json and
    head.safetensors, as `surge optimize` writes them beside a graph): backbone tensors under
    `prefix`, head tensors as saved. Used where only the backbone travels (the GPU machine)."""
    import torch
    from safetensors.torch import load_file, save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {prefix + k: v.float().contiguous() for k, v in load_file(str(Path(backbone_dir) / "model.safetensors")).items()
          if not k.startswith("pooler.")}
    sd.update({k: v.float().contiguous() for k, v in load_file(str(Path(head_dir) / "head.safetensors")).items()})
    save_file({k: v.to(torch.float32) for k, v in sd.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    copy_tokenizer(backbone_dir, out)
    shutil.copy(Path(head_dir) / "config.json", out / "config.json")
    return out

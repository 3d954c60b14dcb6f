"""Several heads on one backbone: the check that they really share it.

A head trained on a frozen backbone (models/finetune.py does that) can be
served next to others on one backbone pass. A head whose checkpoint carries a
different (fine-tuned) backbone would give other answers there, so its
backbone tensors are compared with the served one's (a sample: the word
embeddings and every layer's last LayerNorm, enough to catch any fine-tuning).
"""

from __future__ import annotations

import numpy as np

from surge.errors import ConfigError
from surge.models.hf import ModelSpec

_SAMPLED = ("embeddings.word_embeddings.weight", "embeddings.LayerNorm.weight")


def _sample_names(spec: ModelSpec) -> list[str]:
    names = list(_SAMPLED)
    if spec.model_type == "distilbert":
        names = ["embeddings.word_embeddings.weight"]
        names += [f"transformer.layer.{i}.output_layer_norm.weight" for i in range(spec.num_layers)]
    else:
        names += [f"encoder.layer.{i}.output.LayerNorm.weight" for i in range(spec.num_layers)]
    return names


def check_same_backbone(base: ModelSpec, head: ModelSpec, name: str) -> None:
    from surge.engines.heads import _Tensors

    for attr in ("model_type", "hidden_size", "num_layers", "vocab_size"):
        if getattr(base, attr) != getattr(head, attr):
            raise ConfigError(f"head '{name}' ({head.path}) has {attr} {getattr(head, attr)}, the backbone "
                              f"{getattr(base, attr)}: a head must be trained on the served backbone")
    a, b = _Tensors(base.path), _Tensors(head.path)
    for n in _sample_names(base):
        ka, kb = a.find(n), b.find(n)
        if ka is None or kb is None:
            raise ConfigError(f"head '{name}': cannot compare backbone tensor {n} ({head.path})")
        if not np.array_equal(a.get(ka), b.get(kb)):
            raise ConfigError(f"head '{name}' ({head.path}) was trained with a different backbone ({n} differs): "
                              "serve it as its own model, or train the head on the frozen backbone")

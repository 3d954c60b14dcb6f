"""Structured pruning: remove the attention heads that matter least, the same number in every layer.

Importance of a head = how much the sentence embeddings of the calibration
text move (1 - mean cosine) when that head alone is silenced; for a task model
(classify, rerank, token-classify), how much its predictions move: the mean
total-variation distance of the label probabilities (softmax; a one-logit
reranker's sigmoid), per input or per token, so that the heads its labels need
are kept rather than the ones its backbone's embeddings need. A head is
silenced by zeroing its slice of the attention output projection's input, so
no model code is patched. Pruning slices the Q/K/V projections' output rows
and the output projection's input columns; BERT's attention reshapes with -1
heads, so the smaller layer runs unchanged and exports as usual. The same
count per layer keeps one `num_heads` for the fused Attention op.

The accuracy gate, not this module, decides whether the pruned model is good
enough.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from surge.models.hf import ModelSpec


@dataclass
class PruneResult:
    onnx_file: Path
    heads_total: int
    heads_removed: int
    heads_per_layer: int
    removed: dict[int, list[int]] = field(default_factory=dict)
    importance: list[list[float]] = field(default_factory=list)
    measured_on: str = "embeddings"  # or "logits" (task models)

    def to_json(self) -> dict:
        return {"method": "head ablation on calibration text, uniform per layer", "measured_on": self.measured_on,
                "heads_total": self.heads_total,
                "heads_removed": self.heads_removed, "heads_per_layer": self.heads_per_layer,
                "removed": {str(k): v for k, v in self.removed.items()},
                "importance": [[round(x, 6) for x in row] for row in self.importance]}


def _layers(model):
    encoder = getattr(model, "encoder", None)
    if encoder is None or not hasattr(encoder, "layer"):
        from surge.errors import ConfigError

        raise ConfigError(f"head pruning supports BERT-style encoders; {type(model).__name__} has no encoder.layer")
    return list(encoder.layer)


def _embed(model, batches, spec: ModelSpec):
    import torch

    out = []
    with torch.inference_mode():
        for ids, mask, types in batches:
            hidden = model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = hidden[:, 0] if spec.pooling == "cls" else (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            out.append(torch.nn.functional.normalize(pooled, dim=1))
    return torch.cat(out)


def _probabilities(full, batches, spec: ModelSpec):
    """A task model's label probabilities: [N, labels] per input, or [T, labels] over real tokens."""
    import torch

    out = []
    with torch.inference_mode():
        for ids, mask, types in batches:
            logits = full(input_ids=ids, attention_mask=mask, token_type_ids=types).logits.float()
            if logits.dim() == 3:
                logits = logits[mask.bool()]
            out.append(torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1))
    return torch.cat(out)


def head_importance(model, spec: ModelSpec, texts: list[str], progress=None, full=None) -> np.ndarray:
    """[layers, heads] importance: 1 - mean cosine of embeddings with the head silenced; with `full`
    (the task model around `model`), the mean total-variation distance of its label probabilities."""
    import torch

    from surge.optimize.validate import Encoded

    pairs = spec.task == "rerank"
    data = Encoded(spec, _pairs(texts) if pairs else texts, batch_size=32)
    batches = [(torch.from_numpy(b.input_ids), torch.from_numpy(b.attention_mask), torch.from_numpy(b.token_type_ids))
               for b in data.batches]
    if full is not None:
        reference = _probabilities(full, batches, spec)

        def moved() -> float:
            p = _probabilities(full, batches, spec)
            if p.shape[-1] == 1:
                return float((p - reference).abs().mean())
            return float(0.5 * (p - reference).abs().sum(-1).mean())
    else:
        reference = _embed(model, batches, spec)

        def moved() -> float:
            return float(1.0 - (_embed(model, batches, spec) * reference).sum(1).mean())
    layers = _layers(model)
    heads = spec.num_heads
    size = spec.hidden_size // heads
    scores = np.zeros((len(layers), heads))
    for li, layer in enumerate(layers):
        dense = layer.attention.output.dense
        for h in range(heads):
            if progress:
                progress(f"head importance: layer {li + 1}/{len(layers)}, head {h + 1}/{heads}")

            def silence(module, args, h=h):
                x = args[0].clone()
                x[..., h * size : (h + 1) * size] = 0
                return (x,)

            handle = dense.register_forward_pre_hook(silence)
            try:
                scores[li, h] = moved()
            finally:
                handle.remove()
    return scores


def _pairs(texts: list[str]) -> list[tuple[str, str]]:
    """A reranker's calibration pairs: each text against the next (query, document)."""
    return [(a, b) for a, b in zip(texts, texts[1:] + texts[:1])]


def prune_heads(model, keep: dict[int, list[int]], head_size: int) -> None:
    """Slice each layer's attention down to the heads in keep[layer], in place."""
    import torch

    for li, layer in enumerate(_layers(model)):
        idx = torch.cat([torch.arange(h * head_size, (h + 1) * head_size) for h in keep[li]])
        attn = layer.attention.self
        for name in ("query", "key", "value"):
            lin = getattr(attn, name)
            new = torch.nn.Linear(lin.in_features, len(idx), bias=lin.bias is not None)
            new.weight.data = lin.weight.data[idx].clone()
            if lin.bias is not None:
                new.bias.data = lin.bias.data[idx].clone()
            setattr(attn, name, new)
        out = layer.attention.output.dense
        new = torch.nn.Linear(len(idx), out.out_features, bias=out.bias is not None)
        new.weight.data = out.weight.data[:, idx].clone()
        if out.bias is not None:
            new.bias.data = out.bias.data.clone()
        layer.attention.output.dense = new
        attn.num_attention_heads = len(keep[li])
        attn.all_head_size = len(idx)


def prune_and_export(spec: ModelSpec, fraction: float, texts: list[str], out_file: Path, progress=None,
                     max_texts: int = 64) -> PruneResult:
    from surge.optimize.export import export_model, load_torch_model, task_graph

    # A task model is pruned inside its head model, so the pruned graph keeps the head as the source does.
    task = task_graph(spec)
    full = load_torch_model(spec, head=task)
    model = full.base_model
    scores = head_importance(model, spec, texts[:max_texts], progress, full=full if task else None)
    heads = spec.num_heads
    drop = min(int(round(fraction * heads)), heads - 1)
    keep, removed = {}, {}
    for li, row in enumerate(scores):
        order = np.argsort(row)  # least important first
        removed[li] = sorted(int(h) for h in order[:drop])
        keep[li] = sorted(int(h) for h in order[drop:])
    prune_heads(model, keep, spec.hidden_size // heads)
    if progress:
        progress(f"exporting the pruned model ({heads - drop} heads per layer)")
    export_model(full, spec, out_file)
    return PruneResult(out_file, heads * len(scores), drop * len(scores), heads - drop, removed, scores.tolist(),
                       "logits" if task else "embeddings")

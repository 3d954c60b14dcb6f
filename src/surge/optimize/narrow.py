"""Narrower FFNs for distilled students: choose each layer's most important neurons, slice, refit.

`choose_ffn` ranks each layer's FFN neurons by mean |activation| over real tokens x the norm of the
neuron's output weight column; `narrow_ffn` slices the intermediate and output projections to the
chosen neurons (exactly the teacher with the others silenced); `refit_ffn` then refits the output
projection by least squares so that the kept neurons reproduce the full FFN's output on training text.
Measured in docs/benchmarks/optimizer.md (Issue 21, session 8).
"""

from __future__ import annotations


def ffn_importance(model, ids, mask) -> list:
    """Per encoder layer, each FFN neuron's importance on a batch: mean |activation| over the real tokens
    x the norm of the neuron's output weight column (how far the neuron moves the residual stream)."""
    import torch

    base = getattr(model, model.base_model_prefix, model)
    real = mask.bool()
    scores: list = []
    handles = []

    def hook(module, args, output, li):
        scores[li] = output[real].abs().mean(0).float()

    for li, layer in enumerate(base.encoder.layer):
        scores.append(None)
        handles.append(layer.intermediate.register_forward_hook(lambda m, a, o, li=li: hook(m, a, o, li)))
    try:
        with torch.inference_mode():
            base(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return [s * layer.output.dense.weight.detach().float().norm(dim=0) for s, layer in zip(scores, base.encoder.layer)]


def narrow_ffn(model, keep: list) -> None:
    """Slice each encoder layer's FFN down to the neurons in keep[layer] (the same count in every layer), in place:
    the intermediate projection's output rows and bias, the output projection's input columns."""
    import torch

    base = getattr(model, model.base_model_prefix, model)
    sizes = {len(k) for k in keep}
    if len(keep) != len(base.encoder.layer) or len(sizes) != 1:
        raise ValueError("narrow_ffn needs one list of neurons per layer, all of one size")
    for layer, idx in zip(base.encoder.layer, keep):
        idx = torch.as_tensor(sorted(int(i) for i in idx))
        up, down = layer.intermediate.dense, layer.output.dense
        new_up = torch.nn.Linear(up.in_features, len(idx), bias=up.bias is not None)
        new_up.weight.data = up.weight.data[idx].clone()
        if up.bias is not None:
            new_up.bias.data = up.bias.data[idx].clone()
        new_down = torch.nn.Linear(len(idx), down.out_features, bias=down.bias is not None)
        new_down.weight.data = down.weight.data[:, idx].clone()
        if down.bias is not None:
            new_down.bias.data = down.bias.data.clone()
        layer.intermediate.dense, layer.output.dense = new_up, new_down
    model.config.intermediate_size = sizes.pop()


REFIT_TEXTS = 2048  # training texts the narrowed FFNs' output projections are refitted on
REFIT_RIDGE = 1e-3  # ridge, relative to the mean diagonal of the kept activations' Gram matrix


def refit_ffn(model, keep: list, batches) -> list[float]:
    """Narrow each layer's FFN to keep[layer] (narrow_ffn) and refit its output projection (weights and bias) by
    least squares so that the kept neurons reproduce the full FFN's output on `batches` [(ids, mask)]: the
    dropped neurons' mean and the part of them the kept ones correlate with are folded into what is kept.
    Measured on MiniLM, FFN 1536 -> 768: the untrained student's held-out mean cosine 0.752 -> 0.912.
    Returns each layer's relative residual (the share of the FFN output's energy the kept neurons miss)."""
    import torch

    base = getattr(model, model.base_model_prefix, model)
    layers = list(base.encoder.layer)
    width = len(keep[0])
    gram = [torch.zeros(width + 1, width + 1, dtype=torch.float64) for _ in layers]
    cross = [torch.zeros(width + 1, layer.output.dense.out_features, dtype=torch.float64) for layer in layers]
    energy = [0.0] * len(layers)
    real: list = [None]
    index = [torch.as_tensor(sorted(int(i) for i in k)) for k in keep]

    def collect(li, act):
        a = act[real[0]]
        y = layers[li].output.dense(a).double()  # the full FFN's output (before dropout and the residual)
        x = torch.cat([a[:, index[li]].double(), torch.ones(len(a), 1, dtype=torch.float64)], 1)
        gram[li] += x.T @ x
        cross[li] += x.T @ y
        energy[li] += float((y ** 2).sum())

    handles = [layer.intermediate.register_forward_hook(lambda m, a, o, li=li: collect(li, o))
               for li, layer in enumerate(layers)]
    try:
        with torch.inference_mode():
            for ids, mask in batches:
                real[0] = mask.bool()
                base(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    narrow_ffn(model, keep)
    residual = []
    for li, layer in enumerate(layers):
        g = gram[li]
        ridge = REFIT_RIDGE * float(g.diagonal()[:width].mean())
        solution = torch.linalg.solve(g + ridge * torch.eye(width + 1, dtype=torch.float64), cross[li])  # [width + 1, H]
        # ||y - x s||^2 = ||y||^2 - 2 tr(s' x'y) + tr(s' x'x s)
        miss = energy[li] - 2 * float((solution * cross[li]).sum()) + float((solution * (g @ solution)).sum())
        residual.append(round(max(miss, 0.0) / max(energy[li], 1e-12), 5))
        with torch.no_grad():
            layer.output.dense.weight.copy_(solution[:width].T.float())
            layer.output.dense.bias.copy_(solution[width].float())
    return residual


def choose_ffn(student, size: int, ids, mask) -> tuple[list, dict]:
    """The `size` most important FFN neurons of each student layer (ffn_importance on the given batch)."""
    import torch

    scores = ffn_importance(student, ids, mask)
    keep = [sorted(int(i) for i in torch.topk(s, size).indices) for s in scores]
    kept_share = [round(float(s[k].sum() / s.sum()), 4) for s, k in zip(scores, keep)]
    return keep, {"how": "mean |activation| x output column norm on the layer-choice texts", "ffn_size": size,
                  "importance_kept_share": kept_share}

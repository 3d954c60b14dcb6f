"""Train task heads on a frozen backbone: the intent classifier and slot tagger that tests serve.

The backbone (the bundled MiniLM) stays frozen, so its features are computed
once and only the heads train (a linear classifier on the pooler output, a
linear tagger on every token): seconds on 2 cores, and every head trained this
way shares the served backbone exactly, so they can run on one backbone pass
(model.yaml `heads:`). Data: surge.data.assistant_commands (generated, with
its provenance). Output: ordinary transformers checkpoints
(`BertForSequenceClassification`, `BertForTokenClassification`) that
transformers' own pipelines load, which is what the tests compare against.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from surge.data.assistant_commands import INTENTS, SLOT_TAGS, Example, generate
from surge.models.build import save_checkpoint


def _features(backbone_dir: Path, examples: list[Example]):
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(backbone_dir))
    # FP32 features whatever the checkpoint stores: transformers 5 loads in the stored dtype, and the heads
    # train in FP32 (a backbone kept in FP16 failed here: Half features into a Float linear layer)
    model = AutoModel.from_pretrained(str(backbone_dir), local_files_only=True, dtype=torch.float32).eval()
    enc = tok([list(e.words) for e in examples], is_split_into_words=True, padding=True, truncation=True,
              return_tensors="pt")
    with torch.no_grad():
        out = model(**enc)
    tags = np.full(enc["input_ids"].shape, -100, dtype=np.int64)
    tag_id = {t: i for i, t in enumerate(SLOT_TAGS)}
    for row, e in enumerate(examples):
        prev = None
        for col, w in enumerate(enc.word_ids(row)):
            if w is None:
                continue
            t = e.tags[w]
            if w == prev and t.startswith("B-"):
                t = "I-" + t[2:]  # continuation subwords of a B- word are I-
            tags[row, col] = tag_id[t]
            prev = w
    return out.pooler_output, out.last_hidden_state, torch.from_numpy(tags)


def _train_linear(x, y, classes: int, steps: int = 200, lr: float = 0.05, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    lin = torch.nn.Linear(x.shape[-1], classes)
    opt = torch.optim.Adam(lin.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(lin(x), y, ignore_index=-100)
        loss.backward()
        opt.step()
    return lin


def train_heads(backbone_dir: Path, out_dir: Path, n_train: int = 270, n_test: int = 90, seed: int = 0) -> dict:
    """Write `out_dir/intent` and `out_dir/slots`; return their held-out accuracies (and the provenance)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    out_dir = Path(out_dir)
    data = generate(n_train + n_test, seed=seed)
    train, test = data[:n_train], data[n_train:]
    intent_id = {t: i for i, t in enumerate(INTENTS)}
    pooled, hidden, tags = _features(backbone_dir, data)
    y = torch.tensor([intent_id[e.intent] for e in data])
    intent = _train_linear(pooled[:n_train], y[:n_train], len(INTENTS))
    h = hidden.reshape(-1, hidden.shape[-1])
    flat_tags = tags.reshape(-1)
    n_tok = n_train * hidden.shape[1]
    slots = _train_linear(h[:n_tok], flat_tags[:n_tok], len(SLOT_TAGS), steps=250)
    with torch.no_grad():
        acc_intent = float((intent(pooled[n_train:]).argmax(-1) == y[n_train:]).float().mean())
        pred = slots(h[n_tok:]).argmax(-1)
        mask = flat_tags[n_tok:] != -100
        acc_slots = float((pred[mask] == flat_tags[n_tok:][mask]).float().mean())

    def build(cls, labels, lin, name):
        m = cls.from_pretrained(str(backbone_dir), local_files_only=True, num_labels=len(labels),
                                id2label=dict(enumerate(labels)), label2id={v: i for i, v in enumerate(labels)})
        with torch.no_grad():
            m.classifier.weight.copy_(lin.weight)
            m.classifier.bias.copy_(lin.bias)
        return save_checkpoint(m.eval(), backbone_dir, out_dir / name)

    import transformers

    transformers.logging.set_verbosity_error()
    build(AutoModelForSequenceClassification, INTENTS, intent, "intent")
    build(AutoModelForTokenClassification, SLOT_TAGS, slots, "slots")
    report = {"data": "surge.data.assistant_commands.generate", "seed": seed, "train": n_train, "test": n_test,
              "backbone": str(backbone_dir), "frozen_backbone": True,
              "intent_accuracy": acc_intent, "slot_token_accuracy": acc_slots}
    (out_dir / "TRAINING.json").write_text(json.dumps(report, indent=2))
    return report


def heldout_commands(n: int = 60, seed: int = 7) -> list[str]:
    """Held-out commands (another seed than training)."""
    return [e.text for e in generate(n, seed=seed)]

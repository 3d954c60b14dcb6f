"""Distillation: a shallower or narrower student initialised from the teacher's own layers, trained to match it.

The student is the teacher's architecture with K of its L layers (the subset
measured closest, the last one always kept: it writes the representation the
pooling reads), its embeddings, and — for a classifier — its head. It may
also be narrower (`ffn_size`): each kept layer keeps its N most important FFN
neurons (mean |activation| x the norm of the neuron's output weight column,
measured on training text), and its FFN output projection is refitted by least
squares so that the kept neurons reproduce the full FFN's output (`refit_ffn`).
A narrower student may keep all L layers: each of its layers then has its own
teacher layer for the hidden-state loss. It is trained on unlabeled text only:
the teacher's outputs on that text are the targets.

Loss per batch (real tokens only; padding carries no meaning):
- 1 - cos(student pooled, teacher pooled): what the gate measures;
- relation: MSE between the student's and the teacher's in-batch cosine
  similarity matrices of the pooled vectors (x RELATION_WEIGHT): retrieval
  is about which sentence is closer to which, and this trains exactly that
  (as MiniLM's own relation distillation does for attention);
- layer-wise hidden states: each student layer's output against the output
  of the teacher layer it was copied from, MSE over the teacher's mean
  square (scale free), summed over layers and x HIDDEN_WEIGHT: the pooled
  vector alone under-constrains the tokens, and the intermediate targets
  give the early layers a signal of their own;
- classifiers: additionally the KL divergence of the softened logits
  (temperature 2, Hinton et al. 2015);
- optionally (`bank_weight`, off by default) a ranking loss over a bank of the
  teacher's pooled vectors of the training texts: each batch sentence's
  softmax over its cosines to BANK_SIZE bank sentences (the sentence itself
  left out, temperature BANK_TEMPERATURE) against the teacher's, KL divergence.
  The gate's top-1 asks which of ~1,800 sentences is nearest; the in-batch
  relation sees 31 others, the bank thousands (session 10).

The word-embedding table is frozen (shared with the teacher); the teacher's
targets (every kept layer's states and the pooled vector) are computed once
per text; batches are length-bucketed (batches of groups of the teacher's
nearest neighbours, so that the relation loss sees close pairs, were measured
and not kept: session 7). Training stops at `steps` or at
`time_budget` seconds, whichever comes first; the learning-rate schedule
(warm-up, then cosine decay) follows whichever is further along, so a time
budget still ends on a decayed rate.

Measured (bundled MiniLM, 6 -> 3 layers): the session-1 recipe (lr 1e-4,
pooled cosine + last-layer MSE, 100 steps) reached mean cosine 0.82; this one
is in docs/benchmarks/optimizer.md (Issue 21, session 2).

Training text: the shipped calibration queries plus the 400 prose sentences
(`surge.data`), 20,000 variants of those queries (augment_queries) and the
shipped distillation text (`surge.data.distill_texts()`: 20,804 utterances and
replies of permissively licensed voice-assistant skills and open-domain chat
messages, see PROVENANCE.md), or a file of one text per line (a query log).
The held-out queries are never trained on, nor near copies of them: the gate
measures the student on them.

Defaults (4 layers, 600 s): measured in docs/benchmarks/optimizer.md, session 7; students by width
(6 layers, FFN 1536 -> 768 / 1024) and bf16 training: session 8.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from surge.errors import ConfigError
from surge.models.hf import ModelSpec, copy_side_files
from surge.optimize.distill_texts import AUGMENTED, augment_queries, default_texts, read_texts  # noqa: F401
from surge.optimize.narrow import REFIT_RIDGE, REFIT_TEXTS, choose_ffn, ffn_importance, narrow_ffn, refit_ffn  # noqa: F401


@dataclass
class DistillOptions:
    layers: int = 4  # 3 layers stay under the gate's mean cosine (docs/benchmarks/optimizer.md, session 7)
    ffn_size: int = 0  # FFN neurons per student layer, the most important kept; 0: the teacher's
    steps: int = 20000  # a ceiling: the time budget ends a default run first
    batch_size: int = 32
    lr: float = 5e-4
    time_budget: float = 600.0  # seconds of training; 0: no limit (steps only)
    layer_choice: str = "measured"  # "measured": the teacher-layer subset whose untrained student is closest; "spaced"
    warmup: float = 0.06  # fraction of steps with a linear learning-rate warm-up
    max_length: int = 128
    seed: int = 0
    texts: list[str] | None = None  # None: the shipped calibration queries + prose sentences
    threads: int = 0
    temperature: float = 2.0
    precision: str = "fp32"  # "bf16": the student's forward and backward under CPU bf16 autocast (weights stay FP32)
    bank_weight: float = 0.0  # weight of the ranking loss over a bank of the teacher's vectors (0: off)
    device: str = "cpu"  # where the targets are computed and the student trains ("cuda" on a GPU machine)

    def check(self, teacher_layers: int, teacher_ffn: int | None = None) -> None:
        if not 1 <= self.layers <= teacher_layers:
            raise ConfigError(f"--layers must be between 1 and {teacher_layers} (the teacher has {teacher_layers})")
        if self.ffn_size < 0 or (teacher_ffn and self.ffn_size > teacher_ffn):
            bound = f" and at most the teacher's {teacher_ffn}" if teacher_ffn else ""
            raise ConfigError(f"--ffn-size must be >= 1{bound} (0: the teacher's), not {self.ffn_size}")
        if self.layers == teacher_layers and (not self.ffn_size or self.ffn_size == teacher_ffn):
            raise ConfigError(f"the student must be smaller than the teacher: --layers below {teacher_layers} "
                              f"or --ffn-size below the teacher's FFN size{f' ({teacher_ffn})' if teacher_ffn else ''}")
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError("--steps and --batch-size must be positive")
        if not 0 < self.lr < 1:
            raise ConfigError("--lr must be in (0, 1)")
        if self.layer_choice not in ("measured", "spaced"):
            raise ConfigError(f"--layer-choice must be 'measured' or 'spaced', not {self.layer_choice!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ConfigError(f"--precision must be 'fp32' or 'bf16', not {self.precision!r}")
        if self.time_budget < 0:
            raise ConfigError("--time-budget must be >= 0 seconds (0: no limit)")
        if self.bank_weight < 0:
            raise ConfigError("--bank-weight must be >= 0 (0: no bank loss)")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ConfigError(f"--device must be cpu or cuda[:N], not {self.device!r}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ConfigError(f"--device {self.device}: no CUDA GPU here")


@dataclass
class DistillResult:
    out_dir: Path
    kept_layers: list[int]
    losses: list[float]
    seconds: float
    texts: int
    info: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        head = self.losses[: max(1, len(self.losses) // 10)]
        tail = self.losses[-max(1, len(self.losses) // 10):]
        return {"kept_layers": self.kept_layers, "steps": len(self.losses), "seconds": round(self.seconds, 1),
                "training_texts": self.texts, "loss_first_10pct": round(float(np.mean(head)), 6),
                "loss_last_10pct": round(float(np.mean(tail)), 6), "losses": [round(x, 6) for x in self.losses],
                **self.info}


def pick_layers(teacher_layers: int, k: int) -> list[int]:
    """K evenly spaced layer indices of L, always ending with the last layer."""
    if k == 1:
        return [teacher_layers - 1]
    picks = np.round(np.linspace(teacher_layers - 1, 0, k)).astype(int)[::-1]
    # linspace from the top keeps the last layer exactly; ties are impossible for k < L
    return sorted({int(i) for i in picks})


MAX_LAYER_SUBSETS = 64  # past this many subsets to try (deep teachers), evenly spaced layers instead
CHOICE_TEXTS = 256  # training texts the subsets are compared on


def choose_layers(teacher, teacher_layers: int, k: int, encoded: list, batch, pooling: str,
                  how: str = "measured") -> tuple[list[int], dict]:
    """The teacher layers the student keeps, and how they were chosen.

    "measured": every subset of K layers that ends with the last one is built untrained and run on the
    first CHOICE_TEXTS training texts; the one whose pooled vectors are closest to the teacher's (mean
    cosine) starts the training. Measured on MiniLM 6 -> 3 (held-out queries): layers [0, 4, 5] start
    at cosine 0.73, the evenly spaced [0, 2, 5] at 0.63, [1, 3, 5] at 0.53.
    """
    import itertools

    import torch
    import torch.nn.functional as F

    spaced = pick_layers(teacher_layers, k)
    subsets = [[*c, teacher_layers - 1] for c in itertools.combinations(range(teacher_layers - 1), k - 1)]
    if how == "spaced" or len(subsets) > MAX_LAYER_SUBSETS or len(subsets) == 1:
        return spaced, {"how": "spaced" if how == "spaced" or len(subsets) == 1 else f"spaced (over {MAX_LAYER_SUBSETS} subsets)"}
    picked = _choice_texts(encoded)
    ids, mask = batch(picked)
    scores = {}
    with torch.inference_mode():
        base = getattr(teacher, teacher.base_model_prefix, teacher)
        want = F.normalize(_pool(base(input_ids=ids, attention_mask=mask).last_hidden_state, mask, pooling), dim=-1)
        for subset in subsets:
            s = make_student(teacher, subset)
            sb = getattr(s, s.base_model_prefix, s)
            got = F.normalize(_pool(sb(input_ids=ids, attention_mask=mask).last_hidden_state, mask, pooling), dim=-1)
            scores[str(subset)] = round(float((got * want).sum(-1).mean()), 4)
    best = max(subsets, key=lambda c: scores[str(c)])
    return best, {"how": "measured (untrained student's mean cosine to the teacher)", "texts": len(picked),
                  "cosine_at_init": scores, "spaced_would_be": spaced}


def _choice_texts(encoded: list) -> list[int]:
    """CHOICE_TEXTS training texts spread over the length range: the layer and neuron choices are measured on them."""
    return sorted(range(len(encoded)), key=lambda i: len(encoded[i]))[:: max(1, len(encoded) // CHOICE_TEXTS)][:CHOICE_TEXTS]


def check_teacher(spec: ModelSpec) -> None:
    """Refuse, before training, a teacher whose head distillation cannot train: the student is built on
    AutoModel or *ForSequenceClassification, so a token tagger's student would be written headless (an
    embedding model served in place of a tagger)."""
    if spec.task not in ("embed", "classify", "rerank"):
        raise ConfigError(f"{spec.path.name} is a {spec.task} model: surge distill trains embedding models, "
                          "classifiers and rerankers (*ForSequenceClassification)", param="model")


def _is_classifier(spec: ModelSpec) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in spec.config.get("architectures") or [])


def _load(spec: ModelSpec):
    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if _is_classifier(spec) else AutoModel
    return cls.from_pretrained(str(spec.path), dtype=torch.float32, attn_implementation="eager",
                               local_files_only=True).eval()


def make_student(teacher, kept: list[int]):
    """A copy of the teacher with only the `kept` encoder layers."""
    import copy

    import torch

    student = copy.deepcopy(teacher)
    base = getattr(student, student.base_model_prefix, student)
    base.encoder.layer = torch.nn.ModuleList([base.encoder.layer[i] for i in kept])
    student.config.num_hidden_layers = len(kept)
    return student


RELATION_WEIGHT = 10.0
HIDDEN_WEIGHT = 0.1
BANK_SIZE = 8192  # bank sentences drawn per step (all of them when there are fewer)
BANK_TEMPERATURE = 0.05  # sharp: the nearest neighbours, what top-1 turns on, carry the loss


def _pool(hidden, mask, pooling: str):
    import torch

    m = mask.unsqueeze(-1).to(hidden.dtype)
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "max":
        return hidden.masked_fill(m == 0, -1e9).max(1).values
    if pooling == "last":
        return hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


def distill(spec: ModelSpec, out_dir: Path, options: DistillOptions,
            on_step: Callable[[int, float, float], None] | None = None) -> DistillResult:
    """Train and write the student as a Hugging Face model directory (no gate here: see cli/distill.py)."""
    import torch
    import torch.nn.functional as F
    from tokenizers import Tokenizer

    teacher_ffn = spec.config.get("intermediate_size")
    check_teacher(spec)
    options.check(spec.num_layers, teacher_ffn)
    if options.threads:
        torch.set_num_threads(options.threads)
    torch.manual_seed(options.seed)
    texts = options.texts or default_texts()
    teacher = _load(spec)
    classifier = _is_classifier(spec)
    pooling = str(spec.pooling)

    tok = Tokenizer.from_file(str(spec.tokenizer_file))
    tok.no_padding()
    tok.enable_truncation(max_length=min(options.max_length, spec.max_length))
    encoded = [e.ids for e in tok.encode_batch(texts)]
    rng = np.random.default_rng(options.seed)

    def batch(indices):
        n = max(len(encoded[i]) for i in indices)
        ids = np.full((len(indices), n), spec.pad_token_id, np.int64)
        mask = np.zeros((len(indices), n), np.int64)
        for row, i in enumerate(indices):
            ids[row, : len(encoded[i])] = encoded[i]
            mask[row, : len(encoded[i])] = 1
        return torch.from_numpy(ids), torch.from_numpy(mask)

    if options.layers == spec.num_layers:
        kept, choice = list(range(spec.num_layers)), {"how": "all (the student is narrower, not shallower)"}
    else:
        kept, choice = choose_layers(teacher, spec.num_layers, options.layers, encoded, batch, pooling,
                                     options.layer_choice)
    student = make_student(teacher, kept)
    ffn_choice = None
    if options.ffn_size and options.ffn_size != teacher_ffn:
        base = getattr(student, student.base_model_prefix, student)
        if not all(hasattr(getattr(layer, "intermediate", None), "dense") and hasattr(getattr(layer, "output", None), "dense")
                   for layer in getattr(getattr(base, "encoder", None), "layer", [None])):
            raise ConfigError(f"--ffn-size supports BERT-style encoders (encoder.layer[i].intermediate.dense); "
                              f"{type(base).__name__} has none")
        # measured on the student itself (after the layer choice): its layers see what it feeds them
        keep, ffn_choice = choose_ffn(student, options.ffn_size, *batch(_choice_texts(encoded)))
        fit = sorted(np.random.default_rng(options.seed + 1).choice(len(encoded), min(REFIT_TEXTS, len(encoded)),
                                                                    replace=False).tolist(), key=lambda i: len(encoded[i]))
        ffn_choice["refit"] = {"texts": len(fit), "ridge": REFIT_RIDGE, "how": "least squares of the kept neurons "
                               "onto the full FFN output", "relative_residual": refit_ffn(
                                   student, keep, (batch(fit[b : b + 64]) for b in range(0, len(fit), 64)))}
    dev = torch.device(options.device)
    # the layer choice and the FFN refit above ran on the CPU; targets and training run on `dev`
    teacher.to(dev)
    student.to(dev)

    def on_dev(indices):  # batch(), on the training device
        ids, mask = batch(indices)
        return ids.to(dev), mask.to(dev)

    student.train()
    # The teacher's outputs are the targets and do not change: computed once per
    # text (in length-sorted batches, no padding waste), not once per step.
    targets = _teacher_targets(teacher, encoded, on_dev, classifier, kept, pooling)
    # The word embeddings stay the teacher's: a third of MiniLM's weights, whose
    # dense gradient and AdamW update cost more than the 3 layers they feed.
    base = getattr(student, student.base_model_prefix, student)
    base.embeddings.word_embeddings.weight.requires_grad_(False)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=options.lr, weight_decay=0.01)
    budget = options.time_budget or float("inf")
    start = time.perf_counter()

    def progress_at(step: int) -> float:  # how far along training is: by steps or by time
        return max(step / options.steps, (time.perf_counter() - start) / budget)

    def rate(step: int) -> float:
        p = progress_at(step)
        warmed = min(1.0, max(p, (step + 1) / options.steps) / options.warmup) if options.warmup else 1.0
        return options.lr * warmed * 0.5 * (1 + math.cos(math.pi * min(1.0, p)))

    bank = F.normalize(torch.stack(targets.pooled).float(), dim=-1) if options.bank_weight else None
    bank_rng = torch.Generator().manual_seed(options.seed)
    batches: list[list[int]] = []
    losses: list[float] = []
    parts = {"cosine": 0.0, "relation": 0.0, "hidden": 0.0}  # the loss's terms (+ "bank" when it is on)
    step, done = 0, False
    while not done:
        if not batches:
            batches = _length_bucketed(encoded, options.batch_size, rng)
        picked = batches.pop()
        ids, mask = on_dev(picked)
        real = mask.bool()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=options.precision == "bf16"):
            s_out = student(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        hidden_loss = 0.0
        for j in range(len(kept)):  # student layer j was teacher layer kept[j]
            want = torch.cat([targets.hidden[i][j] for i in picked])  # [real tokens, H]
            hidden_loss = hidden_loss + F.mse_loss(s_out.hidden_states[j + 1][real].float(), want) / targets.scale[j]
        s_pooled = _pool(s_out.hidden_states[-1].float(), mask, pooling)
        t_pooled = torch.stack([targets.pooled[i] for i in picked])
        cos_loss = (1 - F.cosine_similarity(s_pooled, t_pooled, dim=-1)).mean()
        s_unit, t_unit = F.normalize(s_pooled, dim=-1), F.normalize(t_pooled, dim=-1)
        rel_loss = F.mse_loss(s_unit @ s_unit.T, t_unit @ t_unit.T)
        loss = cos_loss + RELATION_WEIGHT * rel_loss + HIDDEN_WEIGHT * hidden_loss
        bank_loss = torch.zeros(())
        if bank is not None:
            bank_loss = _bank_loss(s_unit, t_unit, bank, picked, bank_rng)
            loss = loss + options.bank_weight * bank_loss
        if classifier:
            tau = options.temperature
            t_logits = torch.stack([targets.logits[i] for i in picked])
            loss = loss + F.kl_div(F.log_softmax(s_out.logits.float() / tau, -1), F.softmax(t_logits / tau, -1),
                                   reduction="batchmean") * tau * tau
        for group in opt.param_groups:
            group["lr"] = rate(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        parts.update(cosine=float(cos_loss.detach()), relation=float(rel_loss.detach()), hidden=float(hidden_loss.detach()))
        if bank is not None:
            parts["bank"] = float(bank_loss.detach())
        step += 1
        reached = progress_at(step)
        done = step >= options.steps or reached >= 1.0
        if on_step:
            on_step(step - 1, losses[-1], 1.0 if done else reached)
    seconds = time.perf_counter() - start
    _write_model_dir(student.to("cpu").eval(), spec, Path(out_dir))
    return DistillResult(Path(out_dir), kept, losses, seconds, len(texts),
                         {"teacher": spec.name, "teacher_layers": spec.num_layers, "student_layers": len(kept),
                          "teacher_ffn_size": teacher_ffn, "student_ffn_size": student.config.intermediate_size,
                          "ffn_choice": ffn_choice,
                          "task": "classify" if classifier else "embed",
                          "loss": f"1-cos(pooled) + {RELATION_WEIGHT:g} MSE(in-batch cosines) + {HIDDEN_WEIGHT:g} "
                                  "sum_layers MSE(hidden)/E[teacher^2]" + (" + KL(logits, T=2)" if classifier else "")
                                  + (f" + {options.bank_weight:g} KL(bank ranking, T={BANK_TEMPERATURE:g}, "
                                     f"{BANK_SIZE} of {len(texts)})" if options.bank_weight else ""),
                          "last_loss_parts": {k: round(v, 6) for k, v in parts.items()},
                          "layer_choice": choice,
                          "steps_planned": options.steps, "time_budget_s": options.time_budget,
                          "stopped_by": "steps" if len(losses) >= options.steps else "time budget",
                          "batch_size": options.batch_size, "lr": options.lr, "seed": options.seed,
                          "precision": options.precision, "bank_weight": options.bank_weight,
                          "device": str(dev)})


def _bank_loss(s_unit, t_unit, bank, picked: list[int], gen):
    """KL(teacher || student) of each batch sentence's softmax over its cosines to BANK_SIZE bank vectors
    (the teacher's; the sentence's own entry masked), at BANK_TEMPERATURE; batchmean."""
    import torch
    import torch.nn.functional as F

    n = bank.shape[0]
    cols = torch.randperm(n, generator=gen)[:BANK_SIZE] if n > BANK_SIZE else torch.arange(n)
    sub = bank[cols.to(bank.device)]
    own = (torch.as_tensor(picked)[:, None] == cols[None, :]).to(bank.device)
    s_logits = (s_unit @ sub.T / BANK_TEMPERATURE).masked_fill(own, float("-inf"))
    t_logits = (t_unit @ sub.T / BANK_TEMPERATURE).masked_fill(own, float("-inf"))
    t_prob = F.softmax(t_logits, -1)
    s_logp = F.log_softmax(s_logits, -1).masked_fill(own, 0.0)
    t_logp = F.log_softmax(t_logits, -1).masked_fill(own, 0.0)
    return (t_prob * (t_logp - s_logp)).sum(-1).mean()


def _length_bucketed(encoded: list, batch_size: int, rng) -> list[list[int]]:
    """One epoch of batches of similar lengths (little padding), in random order."""
    order = list(rng.permutation(len(encoded)))
    chunk = batch_size * 16
    out = []
    for c in range(0, len(order), chunk):
        part = sorted(order[c : c + chunk], key=lambda i: len(encoded[i]))
        out += [part[b : b + batch_size] for b in range(0, len(part), batch_size)]
    rng.shuffle(out)
    return out


@dataclass
class _Targets:
    hidden: list  # per text: per kept layer, that layer's output over the text's tokens [T, H]
    pooled: list  # per text: the teacher's pooled vector [H]
    logits: list  # per text: classifier logits (or None)
    scale: list  # per kept layer: mean square of the teacher's states (the hidden loss is relative to it)


def _teacher_targets(teacher, encoded: list, batch, classifier: bool, kept: list[int], pooling: str) -> _Targets:
    import torch

    hidden: list = [None] * len(encoded)
    pooled: list = [None] * len(encoded)
    logits: list = [None] * len(encoded)
    sq = [0.0] * len(kept)
    count = 0
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    with torch.inference_mode():
        for b in range(0, len(order), 64):
            picked = order[b : b + 64]
            ids, mask = batch(picked)
            out = teacher(input_ids=ids, attention_mask=mask, output_hidden_states=True)
            states = [out.hidden_states[k + 1] for k in kept]  # hidden_states[0] is the embeddings
            p = _pool(out.hidden_states[-1], mask, pooling)
            real = mask.bool()
            for j, h in enumerate(states):
                sq[j] += float((h[real] ** 2).sum())
            count += int(real.sum()) * states[0].shape[-1]
            for row, i in enumerate(picked):
                n = len(encoded[i])
                hidden[i] = [h[row, :n].clone() for h in states]
                pooled[i] = p[row].clone()
                if classifier:
                    logits[i] = out.logits[row].clone()
    return _Targets(hidden, pooled, logits, [max(v / max(count, 1), 1e-12) for v in sq])


def _write_model_dir(student, spec: ModelSpec, out_dir: Path) -> None:
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file():
        raise ConfigError(f"{out_dir} exists and is not a model directory; refusing to overwrite it")
    out_dir.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(str(out_dir), safe_serialization=True)
    copy_side_files(spec.path, out_dir)


def plot_losses(losses: list[float], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=110)
    x = np.arange(1, len(losses) + 1)
    ax.plot(x, losses, lw=0.8, alpha=0.35, label="per step")
    if len(losses) >= 10:
        k = max(5, len(losses) // 25)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(k, len(losses) + 1), smooth, lw=2, label=f"mean of {k}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("distillation loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path

"""The validation gate: an optimized model against the FP32 source on real sentences.

Metrics per sentence set (calibration and held-out): per-sentence cosine of
the pooled embeddings, the largest absolute difference of the hidden states
over real tokens, retrieval top-1 agreement (queries over a disjoint set of
documents, as the issue measures retrieval: see `retrieval_agreement`), strict
and with near-ties counted, each with its 95% interval, and — when
the model directory carries a sequence-classification head — argmax agreement
of the logits computed from that head.

What the gate measures follows the model's task (models/tasks.py):
  classify        argmax agreement of the labels (FP16/BF16: at most 0.2% change); a multi-label head:
                  agreement of each input's whole label set (every sigmoid past 0.5), as it is served;
                  and Cohen's kappa of the labels (multi-label: of every (input, label) decision), so
                  that a candidate answering the commonest label everywhere (kappa 0) is refused even
                  where that label alone meets the agreement floor
  rerank          sentences become (query, document) pairs, 8 queries x 20 documents per set;
                  top-1 agreement of each query's best document (ties within 1e-3 of the
                  score range agree) and NDCG@10 of the candidate's ranking, graded by the
                  FP32 ranking (gain 10 - rank for its top 10); the weighted Kendall tau of each
                  query's ranking (rank_tau: a swap among the best documents costs most) and
                  1 - the largest change of a served relevance score, the logit's sigmoid (rank_score)
  token-classify  per-token label agreement over every real token, and its Cohen's kappa
                  (a tagger that says "O" everywhere meets 0.97 agreement where 97% of tokens are "O")

Besides the two sets (cut at 128 tokens, the shipped sentences are short) the gate measures a long-input
set, joined held-out sentences from 129 tokens up to the model's max length (optimize/long_inputs.py),
on its per-input metrics (cosine, labels, kappa; no retrieval top-1 over its few texts): serving goes up
to the max length. A reranker's long set is pairs: its 8 held-out queries, each with the same 8 documents
of joined held-out sentences, the pairs from 129 tokens up to the max length (long_inputs.long_rerank_pairs),
gated on the reranker's metrics above.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from surge.engines.pooling import l2_normalize, pool
from surge.models.hf import ModelSpec
from surge.optimize.long_inputs import long_rerank_pairs, long_texts
from surge.optimize.retrieval_metrics import (TIE_TOLERANCE, _cosine, nearest_neighbours,  # noqa: F401  (re-exported)
                                              retrieval_agreement, similarities, tail_mean, top1_agreement,
                                              wilson_interval)
from surge.optimize.task_metrics import (  # noqa: F401  (re-exported: the gate's task metrics)
    RERANK_DOCS, RERANK_QUERIES, check_set_sizes, cohen_kappa, label_margin, rank_tau, ranking_agreement, rerank_pairs,
    score_agreement)
from surge.types import TokenBatch


@dataclass(frozen=True)
class Budget:
    """What an artifact must meet to be written; every field is a lower bound."""

    mean_cosine: float = 0.0
    min_cosine: float = 0.0
    top1: float = 0.0  # retrieval agreement, ties within TIE_TOLERANCE counted as agreeing
    top1_strict: float = 0.0  # retrieval agreement, strict: the candidate's best document is the reference's
    argmax: float = 0.0  # classifier models only
    rank_top1: float = 0.0  # rerank models only
    ndcg10: float = 0.0  # rerank models only
    rank_tau: float = 0.0  # rerank models only: weighted Kendall tau of each query's ranking (task_metrics.rank_tau)
    rank_score: float = 0.0  # rerank models only: 1 - the largest change of a served score (task_metrics.score_agreement)
    tokens: float = 0.0  # token-classify models only: per-token label agreement
    kappa: float = 0.0  # classify / token-classify: Cohen's kappa of the labels (task_metrics.cohen_kappa)

    def to_json(self) -> dict:
        return asdict(self)


# kappa: label / token agreement corrected for chance (task_metrics.cohen_kappa). Agreement alone
# passes a candidate that always answers the commonest label wherever that label covers more of the
# inputs than the floor; its kappa is 0. A candidate with kappa k changes at most (1 - k) of the labels
# that chance would not already match, whatever the label frequencies.
# rank_tau / rank_score (rerankers), measured on the random-head test reranker, whose documents' scores lie
# close together (benchmarks/rerank_long_gate.py, docs/benchmarks/optimizer.md session 44): FP16 tau >= 0.98
# and score >= 0.9995 on every set; BF16 tau 0.94 on the long pairs (0.99 short), score 0.995; INT8 without
# any search tau 0.59-0.73 on the long pairs (0.88-0.94 short), score 0.93-0.98; positions past 128 zeroed,
# clamped or wrapped (every short pair identical) tau 0.25-0.43 on the long pairs.
BUDGETS = {
    "fp32": Budget(mean_cosine=0.9999, top1=0.998, argmax=0.998, rank_top1=0.99, ndcg10=0.999, rank_tau=0.99,
                   rank_score=0.999, tokens=0.998, kappa=0.99),
    # FP16/BF16: the gate is argmax / top-1 agreement; the cosine floor
    # catches a model that overflowed to NaN or inf on some inputs.
    "fp16": Budget(mean_cosine=0.999, top1=0.998, argmax=0.998, rank_top1=0.97, ndcg10=0.99, rank_tau=0.95,
                   rank_score=0.995, tokens=0.995, kappa=0.98),
    "bf16": Budget(mean_cosine=0.99, top1=0.998, argmax=0.998, rank_top1=0.95, ndcg10=0.98, rank_tau=0.9,
                   rank_score=0.99, tokens=0.99, kappa=0.95),
    # INT8: every held-out sentence within cosine 0.99 of FP32 (not just the
    # mean: a mean of 0.997 hid sentences at 0.95-0.97), and retrieval top-1 >= 98%.
    # Strict top-1 as well: a near-tie that INT8 breaks the other way is a different answer served.
    "int8": Budget(mean_cosine=0.99, min_cosine=0.99, top1=0.98, top1_strict=0.98, argmax=0.98, rank_top1=0.9,
                   ndcg10=0.95, rank_tau=0.6, rank_score=0.95, tokens=0.97, kappa=0.9),
}
# Pruning and distillation remove computation rather than round it: a mean
# budget (a student is a different model; its worst sentence is reported).
LOSSY = Budget(mean_cosine=0.99, top1=0.98, argmax=0.98, kappa=0.9)


@dataclass
class SetMetrics:
    n: int
    mean_cosine: float
    min_cosine: float
    max_abs_diff: float
    top1: float | None  # strict: the candidate's nearest neighbour is the reference's (None: a task graph)
    top1_tie: float | None  # the candidate's neighbour scores within TIE_TOLERANCE of the reference's best
    argmax: float | None = None
    rank_top1: float | None = None
    ndcg10: float | None = None
    rank_tau: float | None = None  # rerank: weighted Kendall tau of each query's ranking, mean over queries
    rank_score: float | None = None  # rerank: 1 - the largest change of a served relevance score
    tokens: float | None = None
    kappa: float | None = None  # chance-corrected label / token agreement (classify, token-classify)
    tail_cosine: float | None = None  # mean cosine of the worst 1% of sentences (the search's objective)
    top1_tie_ci95: tuple[float, float] | None = None  # Wilson score interval of top1_tie over n queries (95%)
    top1_ci95: tuple[float, float] | None = None  # Wilson score interval of the strict top1 (95%)
    worst: list[dict] | None = None  # the lowest-cosine sentences (index into the set, cosine)
    # The long-input set (optimize/long_inputs.py): gated on its per-input metrics only; a retrieval
    # top-1 over its few texts would be one query away from any floor (a reranker's: its ranking metrics).
    long_inputs: bool = False
    order_worst: list[int] = field(default_factory=list, repr=False)  # every index, worst first (not serialized)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("order_worst")
        return d

    @property
    def objective(self) -> float:
        """What the optimizer's searches maximize: the tail cosine for embeddings; for a task graph
        its task metric (label / token agreement, NDCG@10), the logits' tail cosine breaking ties
        (weighted 1e-4: below one changed label among 10,000)."""
        tail = self.tail_cosine or 0.0
        task = next((v for v in (self.argmax, self.tokens, self.ndcg10) if v is not None), None)
        return tail if task is None or self.top1 is not None else task + 1e-4 * tail


@dataclass
class GateResult:
    passed: bool
    budget: Budget
    sets: dict[str, SetMetrics]
    failures: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"passed": self.passed, "budget": self.budget.to_json(), "failures": self.failures,
                "sets": {k: v.to_json() for k, v in self.sets.items()}}


def session(model: str | Path | bytes, threads: int = 0, disabled_optimizers: list[str] | tuple = (),
            spinning: bool | None = None) -> ort.InferenceSession:
    """An ONNX Runtime CPU session; `disabled_optimizers` as an artifact's manifest lists them,
    `spinning=False` as the serving engine runs (engines/onnxrt.py). `spinning=None` reads SURGE_ORT_SPINNING
    (default on, ONNX Runtime's own default; "0" parks the threads between operators: for a machine whose cores
    another process needs meanwhile, such as a serving process or a second test worker)."""
    if spinning is None:
        spinning = os.environ.get("SURGE_ORT_SPINNING", "1") != "0"
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    from surge.engines.int8_weights import prepared

    src = prepared(model)  # the engines' exact INT8 products on this CPU (engines/int8_weights.py)
    extra = {"disabled_optimizers": list(disabled_optimizers)} if disabled_optimizers else {}
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"], **extra)


# Batch sizes of the "serving" layout: what the server's batcher forms under
# light to heavy load (1 = a lone request; 64 = --max-batch's default region).
SERVING_BATCH_SIZES = (1, 4, 16, 32, 64)


def encode_texts(spec: ModelSpec, texts: list[str], max_length: int = 128) -> list:
    """Token ids per text, truncated, unpadded ([CLS] ... [SEP]), as the server tokenizes."""
    from tokenizers import Tokenizer

    from surge.types import Encoded as Item

    tok = Tokenizer.from_file(str(spec.tokenizer_file))
    tok.no_padding()
    tok.enable_truncation(max_length=min(max_length, spec.max_length))
    vocab = spec.vocab_size
    out = []
    for e in tok.encode_batch(list(texts)):
        ids = np.asarray(e.ids, dtype=np.int64)
        if vocab and ids.size and ids.max() >= vocab:
            raise ValueError(f"token id {int(ids.max())} outside the model's vocabulary ({vocab})")
        out.append(Item(ids, np.asarray(e.type_ids, dtype=np.int64)))
    return out


class Encoded:
    """Sentences tokenized once and laid out in padded batches.

    layout "sorted": length-sorted batches of `batch_size` (least padding: the
    fast layout for searches). layout "serving": a seeded shuffle cut into
    batches whose sizes cycle through SERVING_BATCH_SIZES, so short sentences
    sit beside long ones with heavy padding, as under real traffic: a model
    whose output depends on its batch neighbours shows it here.
    """

    def __init__(self, spec: ModelSpec, texts: list[str], batch_size: int = 32, max_length: int = 128,
                 layout: str = "sorted", seed: int = 0):
        items = encode_texts(spec, texts, max_length)
        if layout == "sorted":
            self.order = np.argsort([len(e) for e in items], kind="stable")
            cuts = list(range(0, len(items), batch_size)) + [len(items)]
        elif layout == "serving":
            self.order = np.random.default_rng(seed).permutation(len(items))
            cuts, i, k = [0], 0, 0
            while i < len(items):
                i = min(len(items), i + SERVING_BATCH_SIZES[k % len(SERVING_BATCH_SIZES)])
                cuts.append(i)
                k += 1
        else:
            raise ValueError(f"layout must be 'sorted' or 'serving', not {layout!r}")
        self.batches = [TokenBatch.pad([items[j] for j in self.order[a:b]], pad_id=spec.pad_token_id)
                        for a, b in zip(cuts, cuts[1:]) if b > a]
        self.texts = texts
        self.layout = layout


@dataclass
class Outputs:
    embeddings: np.ndarray  # [N, H] pooled (and normalized if the model does), input order
    hidden: list[np.ndarray]  # per batch, real tokens only, flattened [T, H]
    cls: np.ndarray  # [N, H] first-token states, input order (classifier heads read these)
    # A task graph (its head inside, optimize/export.py): its logits, [N, labels] in input order
    # for sequence heads; per batch [T, labels] over real tokens for token heads. The fields above
    # then hold the logits too (embeddings: one vector per input / token, see _task_outputs).
    logits: np.ndarray | list[np.ndarray] | None = None
    task: str | None = None  # the task graph's task (models/tasks.py)
    token_rows: np.ndarray | None = None  # token heads: the input (sentence) index of each flat token row
    multi_label: bool = False  # a multi-label head: every label whose sigmoid passes 0.5 is an answer


def run_model(sess: ort.InferenceSession, spec: ModelSpec, data: Encoded) -> Outputs:
    names = {i.name for i in sess.get_inputs()}
    if sess.get_outputs()[0].name == "logits":
        out = _task_outputs(sess, names, data, spec.task)
        out.multi_label = bool(spec.task_info and spec.task_info.multi_label)
        return out
    pooled, hidden, first = [], [], []
    for batch in data.batches:
        feeds = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                 "token_type_ids": batch.token_type_ids}
        (out,) = sess.run(None, {k: v for k, v in feeds.items() if k in names})
        out = out.astype(np.float32)
        p = pool(out, batch, spec.pooling)
        pooled.append(l2_normalize(p) if spec.normalize else p)
        hidden.append(out[batch.attention_mask.astype(bool)])
        first.append(out[:, 0, :])
    emb = np.empty((len(data.texts), pooled[0].shape[1]), np.float32)
    emb[data.order] = np.concatenate(pooled)
    cls = np.empty((len(data.texts), first[0].shape[1]), np.float32)
    cls[data.order] = np.concatenate(first)
    return Outputs(emb, hidden, cls)


def _task_outputs(sess: ort.InferenceSession, names: set, data: Encoded, task: str) -> Outputs:
    """A task graph's logits. `embeddings` gets a continuous signal for the optimizer's searches
    (int8 smoothing, fallback, block lists rank candidates by mean cosine): the logits of each input,
    each token's logits for token heads, and each query's centred document scores for a reranker."""
    seq, tokens, rows = [], [], []
    start = 0
    for batch in data.batches:
        feeds = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                 "token_type_ids": batch.token_type_ids}
        (out,) = sess.run(None, {k: v for k, v in feeds.items() if k in names})
        out = out.astype(np.float32)
        n = len(batch.input_ids)
        if out.ndim == 3:
            mask = batch.attention_mask.astype(bool)
            tokens.append(out[mask])
            rows.append(np.repeat(np.asarray(data.order[start:start + n]), mask.sum(1)))
        else:
            seq.append(out)
        start += n
    if tokens:
        flat = np.concatenate(tokens)
        return Outputs(flat, tokens, flat, tokens, task, token_rows=np.concatenate(rows))
    logits = np.empty((len(data.texts), seq[0].shape[1]), np.float32)
    logits[data.order] = np.concatenate(seq)
    emb = logits
    if task == "rerank":  # one score per (query, document) pair: per query, centred
        emb = logits[:, 0].reshape(RERANK_QUERIES, -1)
        emb = emb - emb.mean(axis=1, keepdims=True)
    return Outputs(emb, [logits], logits, logits, task)


def compare(ref: Outputs, cand: Outputs, head=None) -> SetMetrics:
    if ref.logits is not None:
        return _compare_logits(ref, cand)
    cos = _cosine(ref.embeddings, cand.embeddings)
    diffs = [np.abs(r - c).max() for r, c in zip(ref.hidden, cand.hidden)]
    max_abs = float(np.max(diffs)) if np.all(np.isfinite(diffs)) else float("inf")
    strict = retrieval_agreement(ref.embeddings, cand.embeddings)
    ties = retrieval_agreement(ref.embeddings, cand.embeddings, TIE_TOLERANCE)
    worst = [{"index": int(i), "cosine": round(float(cos[i]), 6)} for i in np.argsort(cos)[:5]]
    out = SetMetrics(len(cos), float(cos.mean()), float(cos.min()), max_abs, float(strict.mean()), float(ties.mean()),
                     tail_cosine=tail_mean(cos), top1_tie_ci95=wilson_interval(int(ties.sum()), len(ties)),
                     top1_ci95=wilson_interval(int(strict.sum()), len(strict)),
                     worst=worst, order_worst=[int(i) for i in np.argsort(cos, kind="stable")])
    if head is None:
        return out
    task = head.head.task
    if task == "classify":
        r, c = head.logits(ref.cls).argmax(1), head.logits(cand.cls).argmax(1)
        out.argmax, out.kappa = float((r == c).mean()), cohen_kappa(r, c)
    elif task == "rerank":
        r = head.logits(ref.cls)[:, 0].reshape(RERANK_QUERIES, -1)
        _rank_metrics(out, r, head.logits(cand.cls)[:, 0].reshape(RERANK_QUERIES, -1))
    elif task == "token-classify":
        r = np.concatenate([head.head.tokens(a).argmax(1) for a in ref.hidden])
        c = np.concatenate([head.head.tokens(b).argmax(1) for b in cand.hidden])
        out.tokens, out.kappa = float((r == c).mean()), cohen_kappa(r, c)
    return out


def _compare_logits(ref: Outputs, cand: Outputs) -> SetMetrics:
    """Task graphs: the task's metric on the logits themselves (no nearest-neighbour top-1: the
    outputs are not embeddings; `top1` is None and the gate skips it, see `check`)."""
    cos = _cosine(ref.embeddings, cand.embeddings)
    diffs = [np.abs(r - c).max() for r, c in zip(ref.hidden, cand.hidden)]
    max_abs = float(np.max(diffs)) if np.all(np.isfinite(diffs)) else float("inf")
    # The logits' cosine is the searches' tie-breaker (SetMetrics.objective); the task metric leads.
    out = SetMetrics(len(cos), float(cos.mean()), float(cos.min()), max_abs, None, None, tail_cosine=tail_mean(cos),
                     worst=[{"index": int(i), "cosine": round(float(cos[i]), 6)} for i in np.argsort(cos)[:5]])
    if ref.task == "token-classify":
        r = np.concatenate([a.argmax(1) for a in ref.logits])
        c = np.concatenate([b.argmax(1) for b in cand.logits])
        out.tokens, out.kappa = float((r == c).mean()), cohen_kappa(r, c)
        # worst first = the sentences whose least safe token is least safe (flipped ones lead)
        margin = label_margin(np.concatenate(ref.logits), np.concatenate(cand.logits))
        per = np.full(int(ref.token_rows.max()) + 1, np.inf)
        np.minimum.at(per, ref.token_rows, margin)
        out.order_worst = [int(i) for i in np.argsort(per, kind="stable")]
    elif ref.task == "rerank":  # one score per (query, document) pair
        r = ref.logits[:, 0].reshape(RERANK_QUERIES, -1)
        _rank_metrics(out, r, cand.logits[:, 0].reshape(RERANK_QUERIES, -1))
        # the worst queries' pairs first (query-major, as rerank_pairs lays them out): a subset keeps
        # whole queries, so its pairs still reshape into [queries, documents]
        docs = r.shape[1]
        out.order_worst = [int(q) * docs + d for q in np.argsort(cos, kind="stable") for d in range(docs)]
    elif ref.multi_label:  # the served answer is the set of labels past 0.5: all of it must agree
        on, margin = ref.logits > 0, np.nan_to_num(cand.logits, nan=0.0)
        out.argmax = float(((cand.logits > 0) == on).all(1).mean())  # NaN is "off": a NaN row disagrees where on
        out.kappa = cohen_kappa(on, cand.logits > 0)  # over every (input, label) decision: "never on" scores 0
        # worst first: the input whose least safe label decision is least safe (negative: flipped)
        out.order_worst = [int(i) for i in np.argsort(np.where(on, margin, -margin).min(1), kind="stable")]
    else:
        r, c = ref.logits.argmax(1), cand.logits.argmax(1)
        out.argmax, out.kappa = float((r == c).mean()), cohen_kappa(r, c)
        out.order_worst = [int(i) for i in np.argsort(label_margin(ref.logits, cand.logits), kind="stable")]
    return out


def _rank_metrics(out: SetMetrics, ref: np.ndarray, cand: np.ndarray) -> None:
    """A reranker's metrics of candidate scores [queries, documents] against the reference's."""
    out.rank_top1, out.ndcg10 = ranking_agreement(ref, np.nan_to_num(cand, nan=-np.inf))
    out.rank_tau, out.rank_score = rank_tau(ref, cand), score_agreement(ref, cand)


def check(budget: Budget, sets: dict[str, SetMetrics]) -> GateResult:
    failures = []
    for name, m in sets.items():
        if m.top1 is None and not np.isfinite(m.max_abs_diff):  # a task graph: its metric, and finite logits
            failures.append(f"{name}: non-finite logits")
        for metric, measured in (("mean_cosine", "mean_cosine"), ("min_cosine", "min_cosine"),
                                 ("top1", "top1_tie"), ("top1_strict", "top1"), ("argmax", "argmax"), ("rank_top1", "rank_top1"),
                                 ("ndcg10", "ndcg10"), ("rank_tau", "rank_tau"), ("rank_score", "rank_score"),
                                 ("tokens", "tokens"), ("kappa", "kappa")):
            value, floor = getattr(m, measured), getattr(budget, metric)
            if value is None or floor <= 0:
                continue
            if m.top1 is None and metric in ("mean_cosine", "min_cosine", "top1_strict"):
                continue  # a task graph's gate is what the task means (its logits are not embeddings)
            if m.long_inputs and metric in ("top1", "top1_strict"):
                continue
            if not value >= floor:  # also catches NaN
                failures.append(f"{name}: {measured} {value:.4f} < {floor}")
    return GateResult(not failures, budget, sets, failures)


class ClassifierHead:
    """The task head a checkpoint carries (engines/heads.py), applied to the hidden states the
    exported graph returns, so that the gate measures what the task means."""

    def __init__(self, head):
        self.head = head

    @classmethod
    def from_model_dir(cls, spec: ModelSpec) -> "ClassifierHead | None":
        if spec.task not in ("classify", "rerank", "token-classify"):
            return None
        from surge.engines.heads import load_head

        info = spec.task_info
        return cls(load_head(spec.path, spec.name, spec.task, spec.model_type, spec.labels, info.multi_label))

    def logits(self, cls_hidden: np.ndarray) -> np.ndarray:
        return self.head.classify(cls_hidden.astype(np.float32))


class Evaluator:
    """The FP32 reference on the calibration and held-out sentences, computed once."""

    def __init__(self, spec: ModelSpec, reference_model: str | Path | bytes, calibration: list[str],
                 heldout: list[str], threads: int = 0):
        self.spec = spec
        self.threads = threads
        self.head = ClassifierHead.from_model_dir(spec)
        sentences = heldout
        if spec.task == "rerank":  # a reranker is measured on (query, document) pairs
            calibration, heldout = rerank_pairs(calibration), rerank_pairs(heldout)
        # The search measures on the calibration set in the fast layout; the gate
        # measures the held-out set as traffic arrives (mixed lengths and batch sizes).
        self.data = {"calibration": Encoded(spec, calibration), "heldout": Encoded(spec, heldout, layout="serving")}
        # ... and on inputs past their 128 tokens, up to the model's max length, as served (long_inputs.py);
        # a reranker's are pairs of its held-out queries with long documents.
        long = long_rerank_pairs(spec, sentences) if spec.task == "rerank" else long_texts(spec, heldout)
        if long:
            self.data["long"] = Encoded(spec, long, batch_size=4, max_length=spec.max_length)
        self.gate_sets = tuple(self.data)
        self.reference_model_bytes = reference_model if isinstance(reference_model, bytes) else Path(reference_model).read_bytes()
        ref = session(self.reference_model_bytes, threads)
        self.reference = {name: run_model(ref, spec, data) for name, data in self.data.items()}
        # Only the gate measures the long set: the searches keep to calibration (the cost of a search step).

    def add_subset(self, name: str, indices: list[int], of: str = "calibration") -> int:
        """A named subset of a set (e.g. its hardest sentences), reference computed; returns its size."""
        texts = [self.data[of].texts[i] for i in indices]
        self.data[name] = Encoded(self.spec, texts)
        self.reference[name] = run_model(session(self.reference_model_bytes, self.threads), self.spec, self.data[name])
        return len(texts)

    def metrics(self, model: str | Path | bytes, sets=None) -> dict[str, SetMetrics]:
        """Per set (default: the gate's, `gate_sets`), the candidate against the reference."""
        sess = session(model, self.threads)
        out = {}
        for name in self.gate_sets if sets is None else sets:
            out[name] = compare(self.reference[name], run_model(sess, self.spec, self.data[name]), self.head)
            out[name].long_inputs = name == "long"
        return out

    def gate(self, model: str | Path | bytes, budget: Budget, sets=None) -> GateResult:
        return check(budget, self.metrics(model, sets))

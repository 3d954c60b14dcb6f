"""Task heads on top of an encoder's last hidden state: classify, rerank, token tags, pooled embeddings.

Every engine returns the last hidden state (padded [B, L, H] or packed
[T, H]); the heads here turn it into what each task means, with the same math
as transformers' `*ForSequenceClassification` / `*ForTokenClassification`
heads (dropout is the identity at inference):

  bert        pooler: tanh(W_p h[CLS] + b_p), then classifier
  roberta     classifier.dense -> tanh -> classifier.out_proj on <s>
  distilbert  pre_classifier -> ReLU -> classifier on [CLS]
  decoders    score (no bias) on the last token that is not padding (Llama / Qwen2 / Qwen3 / Mistral /
              Granite `*ForSequenceClassification`: transformers pools its logits there)
  token       classifier on every token (any backbone)

Heads are small (a few hundred KiB) next to the backbone, so several of them
can share one backbone pass ("encode once, many heads"): a `HeadSet` computes
all of its heads for a batch and lays each input's outputs out in one float32
row, which is what the batcher scatters and the cache stores.

Row layout of one input with n tokens: every sequence head's logits, then
every embedding head's pooled vector (unnormalized), then every token head's
[n, labels] logits, flattened. `HeadSet.split` reads a row back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from surge.blas_threads import one_blas_thread
from surge.engines.pooling import pool
from surge.errors import ConfigError
from surge.types import Layout, TokenBatch

SEQUENCE, TOKEN, POOLED = "sequence", "token", "pooled"


HEAD_FILE = "head.safetensors"
_HEAD_PARTS = ("classifier.", "pre_classifier.", "pooler.")


def save_head_tensors(model_dir: Path, out_dir: Path) -> Path:
    """Copy a checkpoint's head tensors (classifier, pre_classifier, pooler) into out_dir/head.safetensors."""
    from safetensors.numpy import save_file

    t = _Tensors(model_dir)
    keep = {k: t.get(k) for k in t.keys() if any(k.startswith(p) or f".{p}" in f".{k}" for p in _HEAD_PARTS)}
    if not keep:
        raise ConfigError(f"{model_dir}: no head tensors to save")
    out = Path(out_dir) / HEAD_FILE
    save_file(keep, str(out))
    return out


@dataclass
class Head:
    name: str
    task: str  # classify | rerank | token-classify | embed
    labels: tuple[str, ...] = ()
    multi_label: bool = False
    pre: list[tuple[np.ndarray, np.ndarray, str]] = field(default_factory=list, repr=False)  # (W, b, act)
    weight: np.ndarray | None = field(default=None, repr=False)  # classifier [labels, H]
    bias: np.ndarray | None = field(default=None, repr=False)
    pooling: str = "cls"  # embed heads: the model's pooling mode
    width: int = 0  # outputs per sequence (sequence, pooled) or per token (token)
    # sequence heads: "first" token (encoders' [CLS]) or "last" token whose id is not `pad_id` (decoders)
    source: str = "first"
    pad_id: int | None = None

    @property
    def kind(self) -> str:
        if self.task == "token-classify":
            return TOKEN
        return POOLED if self.task == "embed" else SEQUENCE

    def classify(self, cls: np.ndarray) -> np.ndarray:
        """[B, H] first-token states -> [B, labels] logits (float32)."""
        x = cls
        for w, b, act in self.pre:
            x = x @ w.T + b
            x = np.tanh(x) if act == "tanh" else np.maximum(x, 0.0) if act == "relu" else x
        return x @ self.weight.T + self.bias

    def tokens(self, hidden: np.ndarray) -> np.ndarray:
        """[T, H] -> [T, labels]."""
        return hidden @ self.weight.T + self.bias


def _decoder_types():
    from surge.models.decoder import SUPPORTED

    return SUPPORTED


def last_real(batch: TokenBatch, pad_id: int | None) -> np.ndarray:
    """Each sequence's last position whose token is not `pad_id` (its first when all are), as an index
    into the packed [T] / flattened padded [B * L] tokens: where transformers' decoder classifiers pool."""
    if batch.layout is Layout.PACKED:
        starts, ends = batch.cu_seqlens[:-1].astype(np.int64), batch.cu_seqlens[1:].astype(np.int64)
        ids = batch.input_ids
    else:
        starts = np.arange(batch.size, dtype=np.int64) * batch.input_ids.shape[1]
        ends = starts + batch.lengths
        ids = batch.input_ids.reshape(-1)
    if pad_id is None:
        return ends - 1
    pos = np.where(ids != pad_id, np.arange(len(ids)), -1)
    last = np.array([pos[s:e].max(initial=-1) for s, e in zip(starts, ends)], dtype=np.int64)
    return np.where(last < 0, starts, last)


def _act_name(model_type: str) -> str:
    return "relu" if model_type == "distilbert" else "tanh"


class _Tensors:
    """Lazy reads of named tensors from a model directory's weights (safetensors or a torch .bin)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._st = self.path / "model.safetensors"
        if not self._st.is_file() and (self.path / HEAD_FILE).is_file():
            self._st = self.path / HEAD_FILE  # an optimized artifact: the head's tensors only
        self._keys: set[str] | None = None
        self._sd = None

    def keys(self) -> set[str]:
        if self._keys is None:
            if self._st.is_file():
                from safetensors import safe_open

                with safe_open(str(self._st), framework="np") as f:
                    self._keys = set(f.keys())
            else:
                self._keys = set(self._torch().keys())
        return self._keys

    def _torch(self) -> dict:
        if self._sd is None:
            import torch

            self._sd = torch.load(self.path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return self._sd

    def find(self, *names: str) -> str | None:
        keys = self.keys()
        for n in names:
            for k in keys:
                if k == n or k.endswith("." + n):
                    return k
        return None

    def get(self, key: str) -> np.ndarray:
        if self._st.is_file():
            from safetensors import safe_open

            with safe_open(str(self._st), framework="np") as f:
                return np.ascontiguousarray(f.get_tensor(key), dtype=np.float32)
        return self._torch()[key].float().numpy()


def load_head(path: Path, name: str, task: str, model_type: str, labels: tuple[str, ...],
              multi_label: bool = False, pooling: str = "mean", hidden: int = 0, pad_id: int | None = None) -> Head:
    """The head of `task` stored in the model directory `path` (a transformers checkpoint). `pad_id`: a
    decoder's padding token (config.json's pad_token_id), skipped when its head picks the last token."""
    if task == "embed":
        return Head(name, task, pooling=pooling, width=hidden)
    t = _Tensors(path)

    def need(*names: str) -> str:
        key = t.find(*names)
        if key is None:
            raise ConfigError(f"{path}: no {' / '.join(names)} weights for the {task} head (a {model_type} "
                              f"checkpoint with a trained head is needed)")
        return key

    head = Head(name, task, labels, multi_label)
    if task == "token-classify":
        head.weight, head.bias = t.get(need("classifier.weight")), t.get(need("classifier.bias"))
    elif model_type in _decoder_types():
        head.weight = t.get(need("score.weight"))
        head.bias = np.zeros(head.weight.shape[0], np.float32)  # transformers' decoder heads have none
        head.source, head.pad_id = "last", pad_id
    elif model_type == "distilbert":
        head.pre = [(t.get(need("pre_classifier.weight")), t.get(need("pre_classifier.bias")), "relu")]
        head.weight, head.bias = t.get(need("classifier.weight")), t.get(need("classifier.bias"))
    elif t.find("classifier.out_proj.weight"):  # roberta family
        head.pre = [(t.get(need("classifier.dense.weight")), t.get(need("classifier.dense.bias")), "tanh")]
        head.weight, head.bias = t.get(need("classifier.out_proj.weight")), t.get(need("classifier.out_proj.bias"))
    else:  # bert: the pooler belongs to the head (it only ever feeds the classifier)
        head.pre = [(t.get(need("pooler.dense.weight")), t.get(need("pooler.dense.bias")), "tanh")]
        head.weight, head.bias = t.get(need("classifier.weight")), t.get(need("classifier.bias"))
    if head.weight.shape[0] != len(labels):
        raise ConfigError(f"{path}: the {task} head has {head.weight.shape[0]} outputs but config.json names "
                          f"{len(labels)} labels")
    head.width = int(head.weight.shape[0])
    return head


class HeadSet:
    """The heads one backbone pass feeds; `apply` gives one float32 row per input (see the module doc)."""

    def __init__(self, heads: list[Head]):
        if not heads:
            raise ValueError("a HeadSet needs at least one head")
        names = [h.name for h in heads]
        if len(set(names)) != len(names):
            raise ConfigError(f"head names must be unique, got {names}")
        order = {SEQUENCE: 0, POOLED: 1, TOKEN: 2}
        self.heads = sorted(heads, key=lambda h: order[h.kind])
        self.by_name = {h.name: h for h in self.heads}
        self.fixed = sum(h.width for h in self.heads if h.kind != TOKEN)
        self.has_tokens = any(h.kind == TOKEN for h in self.heads)

    def __getitem__(self, name: str) -> Head:
        return self.by_name[name]

    @property
    def first(self) -> Head:
        return self.heads[0]

    def apply(self, hidden: np.ndarray, batch: TokenBatch) -> np.ndarray:
        """[B, fixed] float32 without token heads; else an object array of 1-D float32 rows."""
        with one_blas_thread():  # these GEMMs are small ([B, 384] x [384, 384]): surge/blas_threads.py
            return self._apply(hidden, batch)

    def _apply(self, hidden: np.ndarray, batch: TokenBatch) -> np.ndarray:
        hidden = hidden.astype(np.float32, copy=False)
        packed = batch.layout is Layout.PACKED
        if packed:
            starts = batch.cu_seqlens[:-1].astype(np.int64)
            cls = hidden[starts]
        else:
            cls = hidden[:, 0, :]
        parts = []
        for h in self.heads:
            if h.kind == SEQUENCE and h.source == "last":
                flat = hidden if packed else hidden.reshape(-1, hidden.shape[-1])
                parts.append(h.classify(flat[last_real(batch, h.pad_id)]))
            elif h.kind == SEQUENCE:
                parts.append(h.classify(cls))
            elif h.kind == POOLED:
                parts.append(pool(hidden, batch, h.pooling))
        fixed = np.concatenate(parts, axis=1).astype(np.float32, copy=False) if parts else \
            np.zeros((batch.size, 0), np.float32)
        if not self.has_tokens:
            return np.ascontiguousarray(fixed)
        flat = hidden if packed else hidden[batch.attention_mask.astype(bool)]  # [T, H], sequences in order
        tokens = np.concatenate([h.tokens(flat) for h in self.heads if h.kind == TOKEN], axis=1)
        return self.rows(fixed, tokens, batch.lengths)

    @property
    def token_widths(self) -> list[int]:
        return [h.width for h in self.heads if h.kind == TOKEN]

    def rows(self, fixed: np.ndarray, tokens: np.ndarray | None, lengths: np.ndarray) -> np.ndarray:
        """Rows out of every input's fixed outputs [B, fixed] and every token's [T, sum of token widths]
        (the layout an engine computing the heads itself returns, see TorchEngine.run_heads)."""
        if not self.has_tokens:
            return np.ascontiguousarray(fixed, dtype=np.float32)
        bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        cols = np.concatenate([[0], np.cumsum(self.token_widths)]).astype(np.int64)
        rows = np.empty(len(lengths), dtype=object)
        for i in range(len(lengths)):
            s, e = int(bounds[i]), int(bounds[i + 1])
            rows[i] = np.concatenate([fixed[i]] + [tokens[s:e, cols[k]:cols[k + 1]].reshape(-1)
                                                   for k in range(len(cols) - 1)]).astype(np.float32)
        return rows

    def split(self, row: np.ndarray, name: str, n_tokens: int) -> np.ndarray:
        """One head's output from an input's row: [labels] / [hidden] or, for a token head, [n, labels]."""
        off = 0
        for h in self.heads:
            if h.kind != TOKEN:
                if h.name == name:
                    return row[off:off + h.width]
                off += h.width
        for h in self.heads:
            if h.kind == TOKEN:
                size = n_tokens * h.width
                if h.name == name:
                    return row[off:off + size].reshape(n_tokens, h.width)
                off += size
        raise KeyError(name)

    def embed_rows(self, rows: np.ndarray, name: str | None = None) -> np.ndarray:
        """Pooled vectors [B, hidden] of an embedding head out of `apply`'s rows."""
        head = self.by_name[name] if name else next((h for h in self.heads if h.kind == POOLED), None)
        if head is None or head.kind != POOLED:
            raise ConfigError("this model has no embedding head")
        return np.stack([self.split(r, head.name, 0) for r in rows]).astype(np.float32, copy=False)


def softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))


def scores(head: Head, logits: np.ndarray) -> np.ndarray:
    """What transformers' text-classification pipeline reports: sigmoid for one label or
    multi-label heads, softmax otherwise (function_to_apply's default)."""
    if head.multi_label or len(head.labels) == 1:
        return sigmoid(logits)
    return softmax(logits)

"""Tokenization with Hugging Face `tokenizers`: batched, truncated, unpadded.

Padding is the batcher's business (it knows the batch), so this returns one
`Encoded` per input and leaves the layout to `TokenBatch.pad` / `.pack`.

A `Tokenizer` is safe to call from several threads at once (the tokenize stage's thread, the
task path's executor threads, the event loop): no call changes a tokenizer's settings. Inputs
that must not be truncated go through a second, untruncating copy, and inputs cut from the left
(`left=True`: TEI's truncation_direction "left", the last tokens kept) through a third copy that
`tokenizers` truncates from the left; each copy is made on first use and set up before any thread
sees it. (The first version switched the one tokenizer's truncation off and on around such a call,
and a truncating call on another thread in between got a 3,000-token sequence into a 512-position
model's batch.) `tokenizers` truncates before its post-processor runs, so [CLS] ... [SEP] (or the
model's template) stay around the tokens kept from either end.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as _HFTokenizer

from surge.errors import InvalidInput, PayloadTooLarge
from surge.types import Encoded


# Up to this many texts a call go through the Python fast path (one query on the 2-core machine:
# 14 against 40 us back to back, 41-100 against 90-186 us after sleeps: benchmarks/tokenize_fast.py);
# larger batches go to tokenizers, which releases the GIL and can spread them over threads.
FAST_MAX_TEXTS = 64


class Tokenizer:
    def __init__(self, tokenizer_file: Path, max_length: int, vocab_size: int, pad_id: int = 0):
        self._tok = _HFTokenizer.from_file(str(tokenizer_file))
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=max_length)
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.pad_id = pad_id
        # The count of special tokens added around one sequence ([CLS] ... [SEP]).
        self._n_special = self._tok.post_processor.num_special_tokens_to_add(False) if self._tok.post_processor else 0
        self._full: _HFTokenizer | None = None  # the untruncating copy (see the module's docstring)
        self._left: _HFTokenizer | None = None  # the copy that truncates from the left
        self._copy_lock = threading.Lock()
        # Short ASCII texts of a BERT WordPiece tokenizer, in Python with the same ids (runtime/fast_wordpiece.py).
        from surge.runtime.fast_wordpiece import for_file

        self._fast = for_file(tokenizer_file)

    def encode(self, texts: list[str], truncate: bool = True, left: bool = False) -> list[Encoded]:
        """Tokenize a batch of texts, a too-long one cut at its end (`left`: at its start). Too long and
        truncate=False gives 413."""
        out: list[Encoded | None] = [None] * len(texts)
        fast = self._fast
        if fast is not None and len(texts) <= FAST_MAX_TEXTS:
            # The fast path cuts at the end only. Cutting from the left, it is asked for one token more
            # than the model takes: a text that fits is its answer (nothing to cut), a longer one is
            # left to tokenizers.
            limit = (self.max_length + 1 if left else self.max_length) if truncate else None
            for i, t in enumerate(texts):
                ids = fast.encode(t, limit)
                if ids is not None and not (left and len(ids) > self.max_length):
                    out[i] = Encoded(np.array(ids, dtype=np.int64), np.zeros(len(ids), dtype=np.int64))
        rest = [i for i, e in enumerate(out) if e is None]  # what the fast path declined: tokenizers
        if rest:
            sub = [texts[i] for i in rest]
            encs = self._encode_ids(sub, truncate, left)
            for i, e in zip(rest, encs):
                out[i] = Encoded(np.asarray(e.ids, dtype=np.int64), np.asarray(e.type_ids, dtype=np.int64))
        if not truncate:
            self._check_lengths(len(e.ids) for e in out)
        return out

    def _encode_ids(self, texts: list[str], truncate: bool = True, left: bool = False) -> list:
        """tokenizers' Encodings of `texts`: ids and type ids only (no character offsets) where tokenizers
        has encode_batch_fast (>= 0.21), ~20% faster a call."""
        tok = self._truncating(left) if truncate else self.untruncated
        return getattr(tok, "encode_batch_fast", tok.encode_batch)(texts)

    def _check_lengths(self, lengths) -> None:
        for i, n in enumerate(lengths):
            if n > self.max_length:
                raise PayloadTooLarge(
                    f"input {i} has {n} tokens, more than the model's maximum of {self.max_length} "
                    "(send truncate=true to cut it)",
                    param="input",
                )

    def encodings(self, inputs: list, truncate: bool = True, param: str = "input", left: bool = False) -> list:
        """The tokenizers `Encoding`s of texts or (text, text_pair) tuples (offsets, special-token
        masks, type ids: pairs get token_type_ids 0 then 1). Too long and truncate=False gives 413; too
        long otherwise is cut longest side first, at its end (`left`: at its start), as tokenizers does."""
        if not truncate:
            encs = self.untruncated.encode_batch(inputs)
            for i, enc in enumerate(encs):
                if len(enc.ids) > self.max_length:
                    raise PayloadTooLarge(
                        f"{param}[{i}] has {len(enc.ids)} tokens, more than the model's maximum of "
                        f"{self.max_length} (send truncate=true to cut it)", param=param)
            return encs
        return self._truncating(left).encode_batch(inputs)

    @staticmethod
    def to_encoded(encs: list) -> list[Encoded]:
        return [Encoded(np.asarray(e.ids, dtype=np.int64), np.asarray(e.type_ids, dtype=np.int64)) for e in encs]

    def from_ids(self, sequences: list[list[int]], truncate: bool = True, left: bool = False) -> list[Encoded]:
        """Accept pre-tokenized ids as given (special tokens are the caller's): a too-long sequence keeps
        its first max_length ids (`left`: its last)."""
        out = []
        for i, seq in enumerate(sequences):
            try:
                arr = np.asarray(seq, dtype=np.int64)
            except OverflowError:  # JSON allows any integer; int64 does not (e.g. 2**63)
                raise InvalidInput(f"input {i}: token id out of range [0, {self.vocab_size})", param="input") from None
            except (TypeError, ValueError):
                raise InvalidInput(f"input {i}: token ids must be a non-empty list of integers", param="input") from None
            if arr.ndim != 1 or arr.size == 0:
                raise InvalidInput(f"input {i}: token ids must be a non-empty list of integers", param="input")
            if int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size:
                raise InvalidInput(
                    f"input {i}: token id out of range [0, {self.vocab_size})", param="input"
                )
            if arr.size > self.max_length:
                if not truncate:
                    raise PayloadTooLarge(
                        f"input {i} has {arr.size} tokens, more than the model's maximum of {self.max_length}",
                        param="input",
                    )
                arr = arr[-self.max_length:] if left else arr[: self.max_length]
            out.append(Encoded(arr, np.zeros_like(arr)))
        return out

    @property
    def backend(self) -> _HFTokenizer:
        """The Hugging Face tokenizer (read-only use: e.g. the cache's key normalizer)."""
        return self._tok

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    @property
    def untruncated(self) -> _HFTokenizer:
        """The Hugging Face tokenizer without truncation (a copy of `backend`'s, made once)."""
        return self._full or self._copy("_full", lambda t: t.no_truncation())

    def _truncating(self, left: bool) -> _HFTokenizer:
        """`backend`, or (`left`) its copy that cuts a too-long input from the left (made once)."""
        if not left:
            return self._tok
        return self._left or self._copy(
            "_left", lambda t: t.enable_truncation(max_length=self.max_length, direction="left"))

    def _copy(self, attr: str, setup) -> _HFTokenizer:
        """A copy of `backend` under `attr`, set up by `setup` before it is published there (no thread
        sees a half set-up copy, and no call ever changes a tokenizer another thread may use)."""
        with self._copy_lock:
            tok = getattr(self, attr)
            if tok is None:
                tok = _HFTokenizer.from_str(self._tok.to_str())
                setup(tok)
                setattr(self, attr, tok)
            return tok

    def count_untruncated(self, texts: list[str]) -> list[int]:
        """Token counts with no truncation."""
        return [len(e.ids) for e in self.untruncated.encode_batch(texts)]

    def count(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self._tok.encode_batch(texts)]

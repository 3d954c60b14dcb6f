"""Tokenization with Hugging Face `tokenizers`: batched, truncated, unpadded.

Padding is the batcher's business (it knows the batch), so this returns one
`Encoded` per input and leaves the layout to `TokenBatch.pad` / `.pack`.
"""

from __future__ import annotations

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
        # Ids and type ids only (no character offsets): ~20% faster a call where tokenizers has it (>= 0.21).
        self._encode_ids = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        # Short ASCII texts of a BERT WordPiece tokenizer, in Python with the same ids (runtime/fast_wordpiece.py).
        from surge.runtime.fast_wordpiece import for_file

        self._fast = for_file(tokenizer_file)

    def encode(self, texts: list[str], truncate: bool = True) -> list[Encoded]:
        """Tokenize a batch of texts. Too long and truncate=False gives 413."""
        out: list[Encoded | None] = [None] * len(texts)
        fast = self._fast
        if fast is not None and len(texts) <= FAST_MAX_TEXTS:
            limit = self.max_length if truncate else None
            for i, t in enumerate(texts):
                ids = fast.encode(t, limit)
                if ids is not None:
                    out[i] = Encoded(np.array(ids, dtype=np.int64), np.zeros(len(ids), dtype=np.int64))
        rest = [i for i, e in enumerate(out) if e is None]  # what the fast path declined: tokenizers
        if rest:
            sub = [texts[i] for i in rest]
            if not truncate:
                self._tok.no_truncation()
                try:
                    encs = self._encode_ids(sub)
                finally:
                    self._tok.enable_truncation(max_length=self.max_length)
            else:
                encs = self._encode_ids(sub)
            for i, e in zip(rest, encs):
                out[i] = Encoded(np.asarray(e.ids, dtype=np.int64), np.asarray(e.type_ids, dtype=np.int64))
        if not truncate:
            self._check_lengths(len(e.ids) for e in out)
        return out

    def _check_lengths(self, lengths) -> None:
        for i, n in enumerate(lengths):
            if n > self.max_length:
                raise PayloadTooLarge(
                    f"input {i} has {n} tokens, more than the model's maximum of {self.max_length} "
                    "(send truncate=true to cut it)",
                    param="input",
                )

    def encodings(self, inputs: list, truncate: bool = True, param: str = "input") -> list:
        """The tokenizers `Encoding`s of texts or (text, text_pair) tuples (offsets, special-token
        masks, type ids: pairs get token_type_ids 0 then 1). Too long and truncate=False gives 413."""
        if not truncate:
            self._tok.no_truncation()
            try:
                encs = self._tok.encode_batch(inputs)
            finally:
                self._tok.enable_truncation(max_length=self.max_length)
            for i, enc in enumerate(encs):
                if len(enc.ids) > self.max_length:
                    raise PayloadTooLarge(
                        f"{param}[{i}] has {len(enc.ids)} tokens, more than the model's maximum of "
                        f"{self.max_length} (send truncate=true to cut it)", param=param)
            return encs
        return self._tok.encode_batch(inputs)

    @staticmethod
    def to_encoded(encs: list) -> list[Encoded]:
        return [Encoded(np.asarray(e.ids, dtype=np.int64), np.asarray(e.type_ids, dtype=np.int64)) for e in encs]

    def from_ids(self, sequences: list[list[int]], truncate: bool = True) -> list[Encoded]:
        """Accept pre-tokenized ids as given (special tokens are the caller's)."""
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
                arr = arr[: self.max_length]
            out.append(Encoded(arr, np.zeros_like(arr)))
        return out

    @property
    def backend(self) -> _HFTokenizer:
        """The Hugging Face tokenizer (read-only use: e.g. the cache's key normalizer)."""
        return self._tok

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def count_untruncated(self, texts: list[str]) -> list[int]:
        """Token counts with no truncation (call from the one thread that uses this tokenizer)."""
        self._tok.no_truncation()
        try:
            return [len(e.ids) for e in self._tok.encode_batch(texts)]
        finally:
            self._tok.enable_truncation(max_length=self.max_length)

    def count(self, texts: list[str]) -> list[int]:
        return [len(e.ids) for e in self._tok.encode_batch(texts)]

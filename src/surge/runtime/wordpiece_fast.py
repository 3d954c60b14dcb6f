"""BERT WordPiece for plain ASCII text in Python: the same ids as `tokenizers`, ~5x less CPU.

Why: a `--workers` front end spends more CPU tokenizing a short sentence than on anything
else. The Rust tokenizer keeps character alignments through normalization and
pre-tokenization (offsets that the serving path never reads): measured on this project's
2-core machine, 75-85 us of CPU for a ~107-character sentence, the same per sentence in batches
(tokenizers' per-call overhead is small; batching does not help). For ASCII text the BERT
pipeline is a few C-level string operations and dict lookups: lowercase, split off whitespace
and ASCII punctuation, look each word up, WordPiece the rare word that is not in the vocabulary.
That is ~14 us here, with the ids equal to `tokenizers`' (tests/unit/test_wordpiece_fast.py
compares them on the bundled sentences and on random text).

Only a tokenizer whose configuration is exactly the BERT one gets this path (BertNormalizer with
clean_text, BertPreTokenizer, WordPiece, a `[CLS] $A [SEP]` template with type ids 0, right-side
truncation), and only for a text that is printable ASCII (tabs and line breaks allowed) and
contains no added token; everything else (`encode` returns None) goes to `tokenizers`, and so
do large batches (runtime/tokenize.FAST_MAX_CHARS: `tokenizers` releases the GIL for them).
SURGE_FAST_WORDPIECE=0 turns it off.
"""

from __future__ import annotations

import json
import os
import re

_PUNCT = "".join(chr(c) for c in range(33, 127) if not chr(c).isalnum())  # Rust's is_ascii_punctuation
_WORD = re.compile("[^\\s%s]+|[%s]" % (re.escape(_PUNCT), re.escape(_PUNCT)))
_SPACES = str.maketrans("\t\n\r", "   ")  # clean_text: tab and line breaks are whitespace


class FastWordPiece:
    def __init__(self, vocab: dict[str, int], prefix: str, max_word_chars: int, unk: int, cls: int, sep: int,
                 lowercase: bool, added: list[str], max_length: int):
        self.vocab = vocab
        self.cont = {k[len(prefix):]: v for k, v in vocab.items() if k.startswith(prefix)}
        self.max_word_chars = max_word_chars
        self.unk, self.cls, self.sep = unk, cls, sep
        self.lowercase = lowercase
        self.added = added  # added tokens' texts (and lowercased): a text holding one takes tokenizers
        self.max_length = max_length

    @classmethod
    def of(cls, tok, max_length: int) -> "FastWordPiece | None":
        """The fast path for a `tokenizers.Tokenizer` configured as BERT's, else None."""
        if os.environ.get("SURGE_FAST_WORDPIECE", "1") == "0":
            return None
        try:
            cfg = json.loads(tok.to_str())
            norm, pre, model, post = cfg["normalizer"], cfg["pre_tokenizer"], cfg["model"], cfg["post_processor"]
            if (norm or {}).get("type") != "BertNormalizer" or not norm.get("clean_text"):
                return None
            if (pre or {}).get("type") != "BertPreTokenizer" or model.get("type") != "WordPiece":
                return None
            trunc = cfg.get("truncation")
            if trunc is not None and (trunc.get("direction", "Right") != "Right" or trunc.get("stride", 0)):
                return None
            vocab = tok.get_vocab(with_added_tokens=False)
            unk = vocab.get(model["unk_token"])
            template = _single_template(post, vocab)
            if unk is None or template is None or max_length < 3:
                return None
            added = [a["content"] for a in cfg.get("added_tokens", [])]
            added = sorted({*added, *(a.lower() for a in added)} - {""})
            return cls(vocab, model.get("continuing_subword_prefix", "##"), model.get("max_input_chars_per_word", 100),
                       unk, *template, lowercase=bool(norm.get("lowercase")), added=added, max_length=max_length)
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def encode(self, text: str) -> list[int] | None:
        """The ids of `text` with [CLS] / [SEP], truncated to max_length; None: not for this path."""
        if not text.isascii():
            return None
        if not text.isprintable():
            text = text.translate(_SPACES)
            if not text.isprintable():
                return None  # other control characters: tokenizers' clean_text decides
        if self.lowercase:
            text = text.lower()
        for a in self.added:
            if a in text:
                return None
        ids = [self.cls]
        get = self.vocab.get
        for w in _WORD.findall(text):
            i = get(w)
            if i is not None and len(w) <= self.max_word_chars:
                ids.append(i)
            else:
                ids.extend(self._pieces(w))
        if len(ids) >= self.max_length:
            del ids[self.max_length - 1:]
        ids.append(self.sep)
        return ids

    def _pieces(self, w: str) -> list[int]:
        """WordPiece's greedy longest-match-first, as tokenizers' WordPiece.tokenize."""
        if len(w) > self.max_word_chars:
            return [self.unk]
        out = []
        start, n = 0, len(w)
        table = self.vocab
        while start < n:
            end = n
            while start < end:
                i = table.get(w[start:end])
                if i is not None:
                    break
                end -= 1
            else:
                return [self.unk]
            out.append(i)
            start = end
            table = self.cont
        return out


def _single_template(post, vocab: dict[str, int]) -> tuple[int, int] | None:
    """(cls id, sep id) when single sequences become [CLS] $A [SEP], every type id 0."""
    if not post:
        return None
    if post.get("type") == "BertProcessing":
        (sep_t, sep), (cls_t, cls) = post["sep"], post["cls"]
        return (cls, sep) if vocab.get(cls_t) == cls and vocab.get(sep_t) == sep else None
    if post.get("type") != "TemplateProcessing":
        return None
    single = post["single"]
    if len(single) != 3 or "Sequence" not in single[1] or single[1]["Sequence"].get("type_id", 0) != 0:
        return None
    ids = []
    for piece in (single[0], single[2]):
        sp = piece.get("SpecialToken")
        if sp is None or sp.get("type_id", 0) != 0:
            return None
        tok = post["special_tokens"].get(sp["id"], {})
        if len(tok.get("ids", ())) != 1:
            return None
        ids.append(tok["ids"][0])
    return ids[0], ids[1]

"""Short ASCII texts tokenized in Python, exactly as `tokenizers` runs a BERT WordPiece pipeline.

Why: a served query is one short sentence, and a lone request's tokenizing is run on cold
caches: 110-170 us on the H200 host for one sentence through `tokenizers`, ~40 us back to
back (docs/benchmarks/serving_core.md, session 5), because its pipeline (added-token matching,
Unicode normalization, pre-tokenizer, model, post-processor, the Python `Encoding` objects)
touches a lot of code and data for a dozen tokens. For ASCII text the BERT pipeline reduces to
a few string operations and a dict lookup a word, which is what this does; numbers are in
docs/benchmarks/serving_core.md, "Session 6".

It applies only where it reproduces the pipeline exactly (`from_tokenizer_json` returns None
otherwise), and only to ASCII text that holds no added token (`encode` returns None otherwise:
the caller uses `tokenizers`). Tested for equality with `tokenizers` on the shipped corpus and
on generated ASCII strings (tests/unit/test_fast_wordpiece.py).

The pipeline, for ASCII input:
- BertNormalizer: clean_text drops NUL and control characters other than tab, newline and
  carriage return, and maps those three to spaces; lowercase (when set); NFD / accent stripping
  and CJK spacing change nothing in ASCII.
- BertPreTokenizer: splits on whitespace and isolates each ASCII punctuation character.
- WordPiece: greedy longest match first, "##" pieces after the first, [UNK] for a word that
  does not split or is longer than max_input_chars_per_word.
- The post-processor's [CLS] ... [SEP] (type ids 0), after truncation to max_length in all.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

# Control characters that clean_text removes (Rust char::is_control, minus \t \n \r), and NUL.
_DROP = {c: None for c in [*range(0, 9), 11, 12, *range(14, 32), 127]}
_WORDS_LOWER = re.compile(r"[0-9a-z]+|[!-/:-@\[-`{-~]")
_WORDS_CASED = re.compile(r"[0-9A-Za-z]+|[!-/:-@\[-`{-~]")
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def for_file(path) -> "AsciiWordPiece | None":
    """`AsciiWordPiece.from_tokenizer_json`, one per file version: a model loaded again (a
    repository's reload, a new version with the same tokenizer) shares the parsed vocabulary
    instead of parsing ~30,000 entries again each time."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError:
        return None
    return _cached(str(p.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=16)
def _cached(path: str, mtime_ns: int, size: int) -> "AsciiWordPiece | None":
    return AsciiWordPiece.from_tokenizer_json(Path(path))


class AsciiWordPiece:
    def __init__(self, vocab: dict[str, int], unk: int, cls: int, sep: int, lowercase: bool,
                 prefix: str = "##", max_word_chars: int = 100, added: tuple[str, ...] = ()):
        self.vocab = vocab
        self.unk, self.cls, self.sep = unk, cls, sep
        self.words = _WORDS_LOWER if lowercase else _WORDS_CASED
        self.lowercase = lowercase
        self.prefix = prefix
        self.max_word_chars = max_word_chars
        self.added = tuple(a for a in added if a)
        self._pieces: dict[str, tuple[int, ...]] = {}  # words seen that are not whole vocab entries

    @classmethod
    def from_tokenizer_json(cls, path: Path) -> "AsciiWordPiece | None":
        """The fast path for this tokenizer.json, or None when its pipeline is not the one above."""
        try:
            spec = json.loads(Path(path).read_text())
        except (OSError, ValueError):
            return None
        norm, pre, model, post = (spec.get(k) or {} for k in ("normalizer", "pre_tokenizer", "model", "post_processor"))
        if (norm.get("type") != "BertNormalizer" or not norm.get("clean_text", True)
                or pre.get("type") != "BertPreTokenizer" or model.get("type") != "WordPiece"):
            return None
        vocab = model.get("vocab")
        unk = model.get("unk_token")
        if not isinstance(vocab, dict) or unk not in vocab:
            return None
        ends = _cls_sep(post)
        if ends is None:
            return None
        added = tuple(t.get("content", "") for t in spec.get("added_tokens") or ())
        # Added tokens that normalization could reach differently would need the full matcher.
        if any(t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word")
               for t in spec.get("added_tokens") or ()):
            return None
        return cls(vocab, vocab[unk], ends[0], ends[1], bool(norm.get("lowercase", True)),
                   model.get("continuing_subword_prefix", "##"), int(model.get("max_input_chars_per_word", 100)),
                   added)

    def encode(self, text: str, max_length: int | None) -> list[int] | None:
        """[CLS] ids [SEP], at most max_length ids (None: all); None when this text needs `tokenizers`."""
        if not text.isascii():
            return None
        if any(a in text for a in self.added):  # matched on the raw text by tokenizers: its job
            return None
        if _CONTROL.search(text) is not None:
            text = text.translate(_DROP)
        if self.lowercase:
            text = text.lower()
        vocab = self.vocab
        out = [self.cls]
        limit = max_length - 1 if max_length is not None else 1 << 62  # room for [SEP]
        for word in self.words.findall(text):
            wid = vocab.get(word)
            if wid is not None:
                out.append(wid)
            else:
                out.extend(self._split(word))
            if len(out) >= limit:
                del out[limit:]
                break
        out.append(self.sep)
        return out

    def _split(self, word: str) -> tuple[int, ...]:
        got = self._pieces.get(word)
        if got is not None:
            return got
        if len(word) > self.max_word_chars:
            got = (self.unk,)
        else:
            vocab, prefix = self.vocab, self.prefix
            pieces, start, n = [], 0, len(word)
            while start < n:
                end, cur = n, None
                while start < end:
                    sub = word[start:end] if start == 0 else prefix + word[start:end]
                    cur = vocab.get(sub)
                    if cur is not None:
                        break
                    end -= 1
                if cur is None:
                    pieces = [self.unk]
                    break
                pieces.append(cur)
                start = end
            got = tuple(pieces)
        if len(self._pieces) < 65536:  # a bounded memo: queries repeat their rare words
            self._pieces[word] = got
        return got


def _cls_sep(post: dict) -> tuple[int, int] | None:
    """(cls id, sep id) of a post-processor that wraps one sequence as [CLS] A [SEP] with type ids 0."""
    kind = post.get("type")
    if kind == "BertProcessing":
        try:
            return int(post["cls"][1]), int(post["sep"][1])
        except (KeyError, IndexError, TypeError, ValueError):
            return None
    if kind != "TemplateProcessing":
        return None
    single = post.get("single") or []
    if len(single) != 3:
        return None
    first, seq, last = single
    try:
        if (seq["Sequence"]["id"] != "A" or seq["Sequence"].get("type_id", 0) != 0
                or first["SpecialToken"].get("type_id", 0) != 0 or last["SpecialToken"].get("type_id", 0) != 0):
            return None
        specials = post.get("special_tokens") or {}
        a, b = specials[first["SpecialToken"]["id"]]["ids"], specials[last["SpecialToken"]["id"]]["ids"]
    except (KeyError, TypeError):
        return None
    if len(a) != 1 or len(b) != 1:
        return None
    return int(a[0]), int(b[0])

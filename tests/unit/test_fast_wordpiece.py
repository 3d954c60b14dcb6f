"""runtime/fast_wordpiece.py gives `tokenizers`' ids exactly, or declines (None) and leaves it to it.

References: the real tokenizer.json of the bundled model and of the BERT-base shape the GPU
benchmark serves, `tokenizers` itself; inputs: every shipped sentence and query, and generated
ASCII strings (punctuation, digits, case, control characters, long words, added tokens)."""

from __future__ import annotations

import json
import random
import string

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer

from surge.data import load_queries, load_sentences
from surge.errors import PayloadTooLarge
from surge.runtime.fast_wordpiece import AsciiWordPiece
from surge.runtime.tokenize import Tokenizer


@pytest.fixture(scope="module")
def tokenizer_file(bundled_spec):
    return bundled_spec.tokenizer_file


def _hf(path, max_length):
    tok = HFTokenizer.from_file(str(path))
    tok.no_padding()
    if max_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length=max_length)
    return tok


def _strings(rng: random.Random, sentences: list[str], n: int) -> list[str]:
    alphabet = string.printable + "\x00\x01\x07\x7f\x0b\x0c\x1f"
    out = []
    for _ in range(n):
        kind = rng.random()
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        if kind < 0.3:
            s = rng.choice(sentences) + s
        elif kind < 0.4:
            s = s + " " + "x" * rng.randint(95, 110) + " " + "Zq" * rng.randint(1, 60)
        elif kind < 0.5:
            s = s.upper()
        elif kind < 0.55:
            s = s + rng.choice(["[CLS]", "[MASK]", "[SEP]", "[PAD]", "[UNK]"]) + s
        out.append(s)
    return out


@pytest.mark.parametrize("max_length", [256, 12, None])
def test_ids_equal_tokenizers_on_real_and_generated_text(tokenizer_file, max_length):
    fast = AsciiWordPiece.from_tokenizer_json(tokenizer_file)
    assert fast is not None
    ref = _hf(tokenizer_file, max_length)
    rng = random.Random()
    real = load_sentences() + load_queries()
    texts = real + _strings(rng, real, 5000)
    taken = 0
    for t in texts:
        got = fast.encode(t, max_length)
        if got is None:
            assert not t.isascii() or any(a in t for a in ("[CLS]", "[MASK]", "[SEP]", "[PAD]", "[UNK]")), repr(t)
            continue
        taken += 1
        assert got == ref.encode(t).ids, repr(t)
    # the point of it: nearly every real query takes the fast path
    assert sum(fast.encode(t, max_length) is not None for t in real) >= 0.9 * len(real)
    assert taken > 0.8 * len(texts)


def test_a_cased_vocabulary_and_other_special_ids_are_followed(tmp_path, tokenizer_file):
    """Lowercase off and [CLS]/[SEP] at other ids: the fast path follows the file, and still agrees."""
    spec = json.loads(open(tokenizer_file).read())
    spec["normalizer"]["lowercase"] = False
    vocab = spec["model"]["vocab"]
    for w in ("Hello", "World", "##S"):  # cased entries the lowercase vocabulary lacks
        vocab[w] = len(vocab)
    specials = spec["post_processor"]["special_tokens"]
    specials["[CLS]"]["ids"], specials["[SEP]"]["ids"] = [7], [9]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    fast = AsciiWordPiece.from_tokenizer_json(path)
    ref = _hf(path, 256)
    taken = 0
    for t in ["Hello World", "HelloS world", "hello WORLDS!", "Hello, World's end."] + load_sentences()[:200]:
        got = fast.encode(t, 256)
        if got is not None:
            taken += 1
            assert got == ref.encode(t).ids, t
    assert taken > 150 and fast.encode("Hello", 256) == [7, vocab["Hello"], 9]


def test_other_pipelines_are_declined(tmp_path, tokenizer_file):
    spec = json.loads(open(tokenizer_file).read())
    for change in (lambda s: s.update(normalizer={"type": "NFKC"}),
                   lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
                   lambda s: s["model"].update(type="BPE"),
                   lambda s: s.update(post_processor=None),
                   lambda s: s["added_tokens"][0].update(normalized=True)):
        bad = json.loads(json.dumps(spec))
        change(bad)
        path = tmp_path / "t.json"
        path.write_text(json.dumps(bad))
        assert AsciiWordPiece.from_tokenizer_json(path) is None


def test_the_served_tokenizer_gives_the_same_arrays_with_and_without_the_fast_path(bundled_spec):
    """A batch mixing ASCII and other texts: the fast path takes the ASCII ones, tokenizers only
    the rest (in the same order), and the arrays equal tokenizers' own for all of them."""
    tok = Tokenizer(bundled_spec.tokenizer_file, max_length=bundled_spec.max_length, vocab_size=bundled_spec.vocab_size)
    assert tok._fast is not None
    plain = Tokenizer(bundled_spec.tokenizer_file, max_length=bundled_spec.max_length, vocab_size=bundled_spec.vocab_size)
    plain._fast = None
    seen: list[str] = []
    hf = tok._encode_ids
    tok._encode_ids = lambda texts, truncate=True, left=False: (seen.extend(texts), hf(texts, truncate, left))[1]
    rng = np.random.default_rng()
    sents = load_sentences()
    ascii_ = [t for t in sents if t.isascii()]
    others = ["Ünïcode text", "naïve café", "日本語の文"]
    texts = [ascii_[i] for i in rng.choice(len(ascii_), 30, replace=False)] + others + [""]
    order = rng.permutation(len(texts))
    texts = [texts[i] for i in order]
    for truncate in (True, False):
        seen.clear()
        a, b = tok.encode(texts, truncate), plain.encode(texts, truncate)
        assert seen == [t for t in texts if t in others]  # only what the fast path declined
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x.ids, y.ids)
            np.testing.assert_array_equal(x.type_ids, y.type_ids)
            assert x.ids.dtype == y.ids.dtype == np.int64
    long = " ".join(ascii_[:40])
    for t in (tok, plain):  # too long with truncate=False: the same 413 naming the input, whichever path
        with pytest.raises(PayloadTooLarge, match="input 1 has"):
            t.encode(["short", long, "naïve"], truncate=False)


def test_one_parsed_vocabulary_per_file_version(tmp_path, tokenizer_file):
    from surge.runtime.fast_wordpiece import for_file

    path = tmp_path / "tokenizer.json"
    path.write_bytes(open(tokenizer_file, "rb").read())
    a, b = for_file(path), for_file(path)
    assert a is not None and a is b  # a model loaded again shares it
    spec = json.loads(path.read_text())
    spec["model"]["vocab"]["zzzqqq"] = len(spec["model"]["vocab"])
    path.write_text(json.dumps(spec))  # a new version of the file: parsed again, its words known
    c = for_file(path)
    assert c is not a and c.encode("zzzqqq", 16) == [a.cls, spec["model"]["vocab"]["zzzqqq"], a.sep]
    assert a.encode("zzzqqq", 16) != c.encode("zzzqqq", 16)
    assert for_file(tmp_path / "missing.json") is None

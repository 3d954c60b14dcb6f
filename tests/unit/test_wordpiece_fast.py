"""The Python WordPiece fast path (runtime/wordpiece_fast.py) gives tokenizers' ids, exactly.

Reference: the Hugging Face `tokenizers` Tokenizer of the same tokenizer.json, with the same
truncation, on the bundled real sentences and on fresh random text (vocabulary words in any
case, punctuation, digits, tabs and line breaks, over-long words, added tokens, control and
non-ASCII characters, texts past the maximum length).
"""

from __future__ import annotations

import random
import string

import numpy as np
import pytest
from tokenizers import Tokenizer as HF
from tokenizers import normalizers

from surge.data import load_sentences
from surge.models import bundled_model_dir, load_model_spec
from surge.runtime.tokenize import Tokenizer
from surge.runtime.wordpiece_fast import FastWordPiece


@pytest.fixture(scope="module")
def spec():
    return load_model_spec(bundled_model_dir())


def _pair(spec, max_length):
    ours = Tokenizer(spec.tokenizer_file, max_length=max_length, vocab_size=spec.vocab_size)
    ref = HF.from_file(str(spec.tokenizer_file))
    ref.no_padding()
    ref.enable_truncation(max_length=max_length)
    return ours, ref


def _check(ours, ref, texts):
    got = [g for i in range(0, len(texts), 2) for g in ours.encode(texts[i:i + 2])]  # fast-path sized calls
    assert got[0].ids.tolist() == ours.encode(texts)[0].ids.tolist()
    want = ref.encode_batch(texts)
    assert len(got) == len(texts)
    for t, g, w in zip(texts, got, want):
        assert g.ids.dtype == np.int64 and g.type_ids.dtype == np.int64
        assert g.ids.tolist() == w.ids, t
        assert g.type_ids.tolist() == w.type_ids, t


def _random_text(rng: random.Random, words: list[str]) -> str:
    parts = []
    plain = rng.random() < 0.6  # most texts without added tokens, control or non-ASCII characters
    for _ in range(rng.randint(1, 40)):
        r = rng.random()
        if plain and 0.83 <= r < 0.92:
            r = 0.0
        if r < 0.45:
            w = rng.choice(words)
            parts.append(rng.choice((w, w.upper(), w.capitalize())))
        elif r < 0.6:
            parts.append("".join(rng.choice(string.ascii_letters + string.digits) for _ in range(rng.randint(1, 14))))
        elif r < 0.75:
            parts.append(rng.choice(string.punctuation) * rng.randint(1, 3))
        elif r < 0.8:
            parts.append(rng.choice(("\t", "\n", "\r\n", "  ")))
        elif r < 0.83:
            parts.append("x" * rng.randint(95, 130))  # around max_input_chars_per_word
        elif r < 0.86:
            parts.append(rng.choice(("[CLS]", "[cls]", "[SEP]", "[MASK]", "[PAD]", "[UNK]", "[unk]")))
        elif r < 0.89:
            parts.append(rng.choice(("\x00", "\x0b", "\x0c", "\x7f", "\x1f")))
        elif r < 0.92:
            parts.append(rng.choice(("café", "naïve", "日本語", "Straße", "–", "\u00a0", "\ufffd", "😀")))
        else:
            parts.append(rng.choice(words) + rng.choice(string.punctuation) + rng.choice(words))
        parts.append(rng.choice((" ", " ", " ", "", "-", ", ")))
    return "".join(parts)


def test_the_bundled_tokenizer_takes_the_fast_path(spec):
    ours, _ = _pair(spec, 128)
    assert ours._fast is not None
    taken = [t for t in load_sentences() if ours._fast.encode(t) is not None]
    assert len(taken) > 0.8 * len(load_sentences())  # most real sentences are plain ASCII


@pytest.mark.parametrize("max_length", [128, 16, 5])
def test_real_sentences_match_tokenizers(spec, max_length):
    ours, ref = _pair(spec, max_length)
    sentences = load_sentences()
    _check(ours, ref, sentences)
    _check(ours, ref, [" ".join(sentences[i:i + 12]) for i in range(0, len(sentences), 12)])  # past the maximum


@pytest.mark.parametrize("max_length", [256, 24])
def test_random_text_matches_tokenizers(spec, max_length):
    ours, ref = _pair(spec, max_length)
    rng = random.Random()
    words = [w for w in ours.backend.get_vocab() if w.isascii() and not w.startswith("[")]
    texts = [_random_text(rng, words) for _ in range(1500)]
    _check(ours, ref, texts)
    for i in range(0, 60, 6):  # batches mixing both paths, in order
        _check(ours, ref, texts[i:i + 6])


def test_truncate_false_is_tokenizers_own(spec):
    from surge.errors import PayloadTooLarge

    ours, _ = _pair(spec, 8)
    with pytest.raises(PayloadTooLarge):
        ours.encode(["one two three four five six seven eight nine ten"], truncate=False)
    assert len(ours.encode(["one two"], truncate=False)[0]) == 4


def test_other_configurations_take_tokenizers(spec, monkeypatch):
    tok = HF.from_file(str(spec.tokenizer_file))
    assert FastWordPiece.of(tok, 128) is not None
    tok.normalizer = normalizers.Lowercase()
    assert FastWordPiece.of(tok, 128) is None
    monkeypatch.setenv("SURGE_FAST_WORDPIECE", "0")
    assert Tokenizer(spec.tokenizer_file, max_length=128, vocab_size=spec.vocab_size)._fast is None


def test_cache_key_normalizer_matches_the_tokenizers_normalizer(spec):
    """The cache's ASCII shortcut (runtime/cache.text_normalizer) keys texts as BertNormalizer does."""
    from surge.runtime.cache import text_normalizer

    hf = HF.from_file(str(spec.tokenizer_file))
    norm = text_normalizer(hf)
    rng = random.Random()
    words = [w for w in hf.get_vocab() if w.isascii() and not w.startswith("[")]
    texts = load_sentences() + [_random_text(rng, words) for _ in range(1500)] + ["A\tB\r\nC  d", " x ", "\x0bA"]
    for t in texts:
        assert norm(t) == " ".join(hf.normalizer.normalize_str(t).split()), repr(t)

"""Incremental detokenization: stop strings cut exactly, held-back text is released at the end."""

from __future__ import annotations

import random

from surge.runtime.detok import TextState
from tests.decoder_models import train_tokenizer


def _stream(tok, ids, stop=(), min_tokens=0):
    state = TextState(lambda x: tok.decode(x, skip_special_tokens=True), stop, min_tokens)
    parts = []
    for i, t in enumerate(ids):
        parts.append(state.add(t, final=i == len(ids) - 1))
        if state.stopped:
            break
    parts.append(state.flush())
    return "".join(parts), state


def test_stream_equals_whole_decode_and_stops_cut_exactly():
    tok = train_tokenizer()
    rng = random.Random(0)
    text = "The augmented assignment falls back to the normal methods. Then it stops here: END of story."
    ids = tok.encode(text).ids
    full = tok.decode(ids)
    out, _ = _stream(tok, ids)
    assert out == full
    for stop in ("END", "here:", ". T", "methods", "zzz", "y."):
        out, state = _stream(tok, ids, (stop,))
        if stop in full:
            assert out == full[: full.index(stop)] and state.stopped
        else:
            assert out == full and not state.stopped
    # several stop strings: the earliest wins
    out, _ = _stream(tok, ids, ("story", "falls"))
    assert out == full[: full.index("falls")]
    # random token soups decode the same in pieces and whole
    for _ in range(20):
        soup = [rng.randrange(3, tok.get_vocab_size()) for _ in range(30)]
        assert _stream(tok, soup)[0] == tok.decode(soup, skip_special_tokens=True)


def test_held_back_prefix_of_a_stop_string_is_not_shown_early():
    tok = train_tokenizer()
    ids = tok.encode("abc ST").ids
    state = TextState(lambda x: tok.decode(x), ("STOP",))
    shown = "".join(state.add(t) for t in ids)
    assert not shown.endswith("ST") and not state.stopped
    assert shown + state.flush() == "abc ST"


class _WholeDecode:
    """The reference: every token decodes all of the stream's tokens (the behaviour before the
    windowed decode), the same holdback and stop rules."""

    def __init__(self, decode, stop=()):
        self.decode, self.stop, self.ids, self.text, self.stopped = decode, stop, [], "", False

    def add(self, token, final=False):
        self.ids.append(token)
        full = self.decode(self.ids)
        cut = None
        if self.stop:
            lo = max(0, len(self.text) - max(len(s) for s in self.stop))
            hits = [i for s in self.stop if (i := full.find(s, lo)) >= 0]
            cut = min(hits) if hits else None
        if cut is not None:
            self.stopped, visible = True, full[:cut]
        elif final:
            visible = full
        else:
            visible = full.rstrip("\ufffd")
            hold = 0
            for s in self.stop:
                for k in range(min(len(s) - 1, len(visible)), 0, -1):
                    if visible.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            visible = visible[:len(visible) - hold]
        if not visible.startswith(self.text):
            return ""
        delta, self.text = visible[len(self.text):], visible
        return delta


def _tokenizers():
    """Byte-level BPE with every byte in its alphabet (characters split over tokens), SentencePiece-
    style Metaspace (a window's first token drops its leading space) and WordPiece (## pieces,
    spaces cleaned up around punctuation)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = ["naïve café déjà vu, 日本語のテキスト 😀 ok.",
            "The augmented assignment falls back. Then it stops!",
            "Ünïcödé wörds: straße, œuvre, 中文, emoji 🎉🎉 and (brackets), e.g. x = y."] * 20
    out = []
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>", "</s>"],
        show_progress=False))
    out.append(t)
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(text, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"],
                                                    show_progress=False))
    out.append(t)
    t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece()
    t.train_from_iterator(text, trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]", "[SEP]"],
                                                          show_progress=False))
    out.append(t)
    return out


def test_windowed_decode_gives_the_whole_decodes_deltas():
    """Delta for delta (and `stopped`, and the flushed rest) what decoding all tokens for each new
    one gives, over text and random token soups (split characters, special tokens skipped), with
    and without stop strings."""
    rng = random.Random(1)
    for tok in _tokenizers():
        dec = lambda x: tok.decode(x, skip_special_tokens=True)  # noqa: E731
        v = tok.get_vocab_size()
        streams = [tok.encode(s).ids for s in ("naïve café 😀 and 日本語, e.g. x = y.", "Then it stops! œuvre")]
        streams += [[rng.randrange(0, v) for _ in range(rng.randrange(1, 60))] for _ in range(150)]
        for ids in streams:
            full = dec(ids)
            stops = [()] + [(full[a:a + n],) for a, n in ((rng.randrange(0, max(1, len(full))), rng.randrange(1, 4)),)
                             if full[a:a + n]] + [("zz", ". ")]
            for stop in stops:
                new, ref = TextState(dec, stop), _WholeDecode(dec, stop)
                for i, t in enumerate(ids):
                    final = i == len(ids) - 1
                    assert new.add(t, final) == ref.add(t, final), (tok.decoder, ids, stop, i)
                    assert new.stopped == ref.stopped
                    if new.stopped:
                        break
                rest = new.flush()
                assert new.text == (ref.text if ref.stopped else dec(ids)) or rest == ""


def test_a_token_decodes_a_short_window():
    """The cost of a token does not grow with the stream: every decode while streaming sees a few
    tokens, not all of them (the flush at the end decodes everything once)."""
    tok = train_tokenizer()
    ids = tok.encode("The augmented assignment falls back to the normal methods. " * 20).ids
    assert len(ids) > 200
    seen = []

    def dec(x):
        seen.append(len(x))
        return tok.decode(x, skip_special_tokens=True)

    state = TextState(dec, ("zzz",))
    out = "".join(state.add(t) for t in ids)
    assert max(seen) <= 4, max(seen)
    assert out + state.flush() == tok.decode(ids)


def test_no_stop_string_ends_the_text_before_min_tokens():
    """vLLM's min_tokens: a stop string inside the first min_tokens tokens' text does not stop it; the
    first one whose text ends after them cuts exactly, and the streamed text is the whole text's prefix."""
    tok = train_tokenizer()
    text = "The target is an assignment. The target is a name. The target is done."
    ids = tok.encode(text).ids
    full = tok.decode(ids)
    first = full.index("target")
    second = full.index("target", first + 1)
    n_first = next(n for n in range(1, len(ids)) if len(tok.decode(ids[:n])) >= first + len("target"))
    out, state = _stream(tok, ids, ("target",), min_tokens=n_first + 3)
    assert out == full[:second] and state.stopped
    out, _ = _stream(tok, ids, ("target",), min_tokens=0)
    assert out == full[:first]
    # reached at the last token: only a match that can end in its text counts (the last "target" is
    # further back than a stop string's length)
    out, state = _stream(tok, ids, ("target",), min_tokens=len(ids))
    assert out == full and not state.stopped


def test_include_stop_str_in_output_keeps_the_match():
    tok = train_tokenizer()
    ids = tok.encode("The target is an assignment. The target is a name.").ids
    full = tok.decode(ids)
    state = TextState(lambda x: tok.decode(x, skip_special_tokens=True), ("assignment",), keep_stop=True)
    text = "".join(state.add(t) for t in ids[:-1]) + state.add(ids[-1], final=True) + state.flush()
    assert state.stopped and text == full[:full.index("assignment") + len("assignment")]


def test_holdback_is_the_longest_end_that_begins_a_stop_string():
    """TextState._holdback tries only the lengths whose stop string's character matches the text's last
    (session 46: trying every length cost each token each stop string's length in slices): the same
    answer as trying every length, on random short alphabets where partial matches abound."""
    import random

    from surge.runtime.detok import TextState

    def every_length(stop, text):
        return max((next((k for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), 0)
                    for s in stop), default=0)

    rng = random.Random(46)
    for _ in range(20_000):
        alphabet = rng.choice(["ab", "abc ", "a\u00e9b"])
        stop = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 9)))
                     for _ in range(rng.randint(1, 3)))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        assert TextState(lambda ids: "", stop)._holdback(text) == every_length(stop, text), (stop, text)

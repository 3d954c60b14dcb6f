"""Incremental detokenization: stop strings cut exactly, held-back text is released at the end."""

from __future__ import annotations

import random

from surge.runtime.detok import TextState
from tests.decoder_models import train_tokenizer


def _stream(tok, ids, stop=()):
    state = TextState(lambda x: tok.decode(x, skip_special_tokens=True), stop)
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

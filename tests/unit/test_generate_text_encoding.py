"""runtime/generate_text.py encodes a long prompt and bad words so that the GIL is let go while the tokenizer
works, and so that it is not held long after: an Encoding that carries every token's offsets took ~40 ms to free
(with the GIL) for a 2 MB chat of 500,000 tokens, while the event loop waited; tokenizers' encode_batch_fast
gives the same ids without offsets (freed in ~1 ms). Checked against the tokenizer's own encode (the reference),
and that the batch calls made are the offset-free ones (a recording wrapper; no timing)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from surge.runtime import generate_text
from surge.runtime.generate_text import PromptText, encode_text
from tests.decoder_models import build_model


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = build_model("qwen2", tmp_path_factory.mktemp("gt") / "m", seed=5)
    return Tokenizer.from_file(str(d / "tokenizer.json"))


class Recording:
    """The tokenizer, with the names of the batch methods called."""

    def __init__(self, tok):
        self._tok, self.calls = tok, []

    def __getattr__(self, name):
        if name.startswith("encode_batch"):
            self.calls.append(name)
        return getattr(self._tok, name)


TEXT = "".join(f"<|im_start|>{'user' if k % 2 == 0 else 'assistant'}\nturn {k} of the loop<|im_end|>\n"
               for k in range(600))  # ~25,000 characters, over LONG_TEXT


@pytest.mark.parametrize("special", [True, False])
def test_a_long_text_is_encoded_without_offsets_to_the_same_ids(tokenizer, special):
    assert len(TEXT) > generate_text.LONG_TEXT
    rec = Recording(tokenizer)
    assert encode_text(rec, TEXT, special) == tokenizer.encode(TEXT, add_special_tokens=special).ids
    assert rec.calls == ["encode_batch_fast"]


def test_bad_words_are_encoded_without_offsets_to_the_same_ids(tokenizer):
    words = [f" w{i}" for i in range(600)] + ["", "<|im_end|> x"]
    p = PromptText()
    p.tokenizer = Recording(tokenizer)
    got = p.encode_many(words, special=False)
    assert got == [tokenizer.encode(w, add_special_tokens=False).ids for w in words]
    assert p.tokenizer.calls and set(p.tokenizer.calls) == {"encode_batch_fast"}

"""Where client values enter: token ids beyond int64, bounded echoes, relative paths (issue 16)."""

from __future__ import annotations

import pytest

from surge.errors import InvalidInput, relative_paths, shown
from surge.server.http.openai import split_input


@pytest.fixture(scope="module")
def tokenizer(bundled_spec):
    from surge.runtime.tokenize import Tokenizer

    s = bundled_spec
    return Tokenizer(s.tokenizer_file, max_length=s.max_length, vocab_size=s.vocab_size, pad_id=s.pad_token_id)


@pytest.mark.parametrize("bad", [2 ** 63, 2 ** 64 - 1, 2 ** 70, -1, -(2 ** 63) - 1, 30522])
def test_from_ids_refuses_what_int64_or_the_vocabulary_cannot_hold(tokenizer, bad):
    with pytest.raises(InvalidInput, match="out of range"):
        tokenizer.from_ids([[101, 102], [101, bad, 102]])
    assert tokenizer.from_ids([[101, 30521, 102]])[0].ids.tolist() == [101, 30521, 102]


@pytest.mark.parametrize("bad", [2 ** 63, 2 ** 64, -1])
def test_split_input_refuses_ids_beyond_int64(bad):
    with pytest.raises(InvalidInput, match="out of range"):
        split_input([[101, bad]], 8, 100)
    assert split_input([[0, 2 ** 63 - 1]], 8, 100) == (None, [[0, 2 ** 63 - 1]])


def test_shown_bounds_names():
    assert shown("enc") == "enc"
    long = shown("x" * 100_000)
    assert len(long) == 65 and long.endswith("\u2026")


def test_relative_paths_strip_the_root_only():
    msg = "/srv/repo/enc/1/model.yaml: bad; /srv/repo2/x; /srv/repo.bak; in /srv/repo (the root)"
    assert relative_paths(msg, "/srv/repo") == "enc/1/model.yaml: bad; /srv/repo2/x; /srv/repo.bak; in . (the root)"

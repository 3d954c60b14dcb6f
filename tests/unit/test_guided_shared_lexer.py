"""A guide's sequences share one parser build (runtime/guided.py, Guides.matcher), session 48's security review.

Each sequence's matcher was built from the guide's grammar anew, and llguidance's lexer with it: a request's
`n` choices (and every later request with the same guide) each paid the lexer's first build in the engine's
step, where every stream waits. A regex `a{500}{500}` costs ~0.3 s there: n=16 held a neighbour's 2-token
answer 5.5 s. Matchers are now copies of one kept per guide (llguidance's deep_copy: the lexer's states are
shared, the parser's position is each copy's own), so the build is paid once. Counted, not timed.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llguidance")

from surge.runtime.guided import MATCHERS_KEPT, Guides, guide_for  # noqa: E402
from tests.decoder_models import train_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def guides():
    return Guides(train_tokenizer(512, True).to_str(), 512, [2])


def _allowed(m) -> list[int]:
    return np.flatnonzero(np.unpackbits(m.mask().view(np.uint8), bitorder="little")[:512]).tolist()


def test_a_guides_matchers_are_copies_of_one_build(guides):
    guide = guide_for("regex", "(ab|b)[ab]{2}", "guided_regex")
    before = guides.built
    ms = [guides.matcher(guide) for _ in range(8)]
    assert guides.built == before + 1
    # each copy keeps its own place in the answer: one that moves on leaves the others at the start
    first = _allowed(ms[0])
    tok = train_tokenizer(512, True)
    a = tok.token_to_id("a")
    assert a in first
    assert ms[0].consume(a)
    assert _allowed(ms[1]) == first and _allowed(ms[0]) != first
    assert all(_allowed(m) == first for m in ms[1:])
    # a later request with the same guide: no new build; another guide: one
    guides.matcher(guide)
    assert guides.built == before + 1
    guides.matcher(guide_for("regex", "[ab]{3}", "guided_regex"))
    assert guides.built == before + 2


def test_kept_builds_are_bounded(guides):
    first = guide_for("regex", "q0[ab]", "guided_regex")
    guides.matcher(first)
    for k in range(1, MATCHERS_KEPT + 1):
        guides.matcher(guide_for("regex", f"q{k}[ab]", "guided_regex"))
    assert len(guides._prototypes) == MATCHERS_KEPT
    before = guides.built
    guides.matcher(first)  # the oldest went: built again
    assert guides.built == before + 1


def test_few_large_guides_builds_are_kept():
    from surge.runtime.guided import CACHED_CHARS, LARGE_KEPT

    guides = Guides(train_tokenizer(512, True).to_str(), 512, [2])
    for k in range(3 * LARGE_KEPT):
        guides.matcher(("grammar", f'start: "a" | "{k}"\n' + "// " + "x" * CACHED_CHARS + "\n"))
    assert len(guides._prototypes) == LARGE_KEPT


def test_a_grammar_past_the_parsers_symbol_bound_is_refused_as_such(guides):
    """30,000 rules in sequence pass llguidance's validation, then its parser panics on its symbol bound at the
    first mask: the request's error says the guide is past the parser's limits, not that no token can start it."""
    from surge.errors import InvalidInput

    n = 30_000
    text = "start: " + " ".join(f"r{i}" for i in range(n)) + "\n" + "\n".join(f'r{i}: "a" | "b"' for i in range(n))
    with pytest.raises(InvalidInput) as err:
        guides.check(guide_for("grammar", text, "guided_grammar"), "guided_grammar")
    assert "parser's limits" in err.value.message and "can start" not in err.value.message, err.value.message

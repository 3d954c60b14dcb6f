"""One Tokenizer called from several threads at once (the tokenize stage's thread, the task path's
executor threads, the event loop): a call never sees another call's truncation setting."""

from __future__ import annotations

import threading

import pytest

from surge.errors import PayloadTooLarge


@pytest.fixture()
def tokenizer(bundled_spec):
    from surge.runtime.tokenize import Tokenizer

    s = bundled_spec
    return Tokenizer(s.tokenizer_file, max_length=s.max_length, vocab_size=s.vocab_size, pad_id=s.pad_token_id)


LONG = "word " * 3000  # ~3,000 tokens: far past the bundled model's 256
PAIR = ("a query", LONG)


def test_untruncated_calls_leave_the_truncating_tokenizer_as_it_was(tokenizer):
    before = tokenizer.backend.truncation
    assert before is not None and before["max_length"] == tokenizer.max_length
    assert tokenizer.count_untruncated([LONG]) == [3002]
    with pytest.raises(PayloadTooLarge):
        tokenizer.encode([LONG, "ok"], truncate=False)
    with pytest.raises(PayloadTooLarge):
        tokenizer.encodings([PAIR], truncate=False)
    assert tokenizer.backend.truncation == before
    assert len(tokenizer.backend.encode(LONG).ids) == tokenizer.max_length
    assert tokenizer.untruncated is tokenizer.untruncated  # made once


def test_truncating_and_untruncating_calls_on_several_threads(tokenizer):
    """Half the threads ask for truncation, half refuse it, all at once, many times over: every
    truncated answer fits the model and every refusing call gets its 413."""
    rounds, threads = 30, 8
    start = threading.Barrier(threads)
    wrong: list[str] = []

    def work(k: int) -> None:
        start.wait()
        for _ in range(rounds):
            if k % 2:
                for call in (lambda: tokenizer.encodings([PAIR, LONG], truncate=False),
                             lambda: tokenizer.encode([LONG] * 4, truncate=False)):
                    try:
                        call()
                        wrong.append("an untruncated call was truncated")
                    except PayloadTooLarge:
                        pass
                    except Exception as exc:  # noqa: BLE001 - e.g. the tokenizer borrowed by another thread
                        wrong.append(f"{type(exc).__name__}: {exc}")
            else:
                try:
                    lengths = [len(e.ids) for e in tokenizer.encodings([PAIR, LONG], truncate=True)]
                    lengths += [len(e) for e in tokenizer.encode([LONG] * 4, truncate=True)]
                except Exception as exc:  # noqa: BLE001
                    wrong.append(f"{type(exc).__name__}: {exc}")
                    continue
                if max(lengths) > tokenizer.max_length:
                    wrong.append(f"a truncating call got {max(lengths)} tokens")

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not wrong, wrong[:5]

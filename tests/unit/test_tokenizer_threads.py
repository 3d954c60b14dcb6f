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


def _reference(tokenizer, inputs: list, direction: str) -> list[list[int]]:
    """The `tokenizers` library's own truncation of `inputs` from `direction`, on a tokenizer of its own."""
    from tokenizers import Tokenizer as HF

    ref = HF.from_str(tokenizer.backend.to_str())
    ref.enable_truncation(max_length=tokenizer.max_length, direction=direction)
    return [e.ids for e in ref.encode_batch(inputs)]


def test_left_truncation_is_the_libraries_on_every_path(tokenizer):
    """encode(left=True) keeps [CLS], the last tokens, [SEP]: on the Python fast path (ASCII texts that
    fit, or fit but one) and through `tokenizers` (longer, non-ASCII); pairs cut the longer side from
    its start; token ids keep their last max_length ids; the shared tokenizer is never changed."""
    before = tokenizer.backend.truncation
    n = tokenizer.max_length
    words = " ".join(f"w{i}" for i in range(400))  # "w", "##0", ...: several tokens a word
    # around the boundary: untouched texts (fast path) and texts one or a few tokens too long
    texts = [" ".join(["word"] * k) for k in (n - 3, n - 2, n - 1, n, n + 5)] + [words, "café " * 300, "hi"]
    want = _reference(tokenizer, texts, "left")
    got = [e.ids.tolist() for e in tokenizer.encode(texts, truncate=True, left=True)]
    assert got == want
    assert got[-3] != tokenizer.encode([words])[0].ids.tolist()  # right truncation differs
    assert [e.ids for e in tokenizer.encodings([PAIR, ("q " * 300, "short")], left=True)] == \
        _reference(tokenizer, [PAIR, ("q " * 300, "short")], "left")
    ids = list(range(1000, 1000 + n + 10))
    assert tokenizer.from_ids([ids], left=True)[0].ids.tolist() == ids[-n:]
    assert tokenizer.from_ids([ids])[0].ids.tolist() == ids[:n]
    assert tokenizer.backend.truncation == before and tokenizer.backend.truncation["direction"] == "right"


def test_left_and_right_calls_on_several_threads(tokenizer):
    """Left-truncating calls and right-truncating ones at once: each gets its own end of the text."""
    text = " ".join(f"w{i}" for i in range(3000))
    want = {d: _reference(tokenizer, [text], d)[0] for d in ("left", "right")}
    threads, rounds = 8, 20
    start = threading.Barrier(threads)
    wrong: list[str] = []

    def work(k: int) -> None:
        start.wait()
        left = bool(k % 2)
        for _ in range(rounds):
            try:
                got = [e.ids.tolist() for e in tokenizer.encode([text] * 3, left=left)]
                got += [e.ids for e in tokenizer.encodings([text], left=left)]
            except Exception as exc:  # noqa: BLE001 - reported below, not lost with the thread
                wrong.append(f"{type(exc).__name__}: {exc}")
                return
            if any(g != want["left" if left else "right"] for g in got):
                wrong.append(f"a {'left' if left else 'right'} call got the other end")

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not wrong, wrong[:5]

"""About the memory a generation-cache entry holds (runtime/generate_service.py's `cache_bytes`), as CPython
objects: its key (the prompt's token ids, the sampling fields) and its answer (deltas, log-probabilities).

Estimates from lengths, not a walk of the objects: a request of 100,000 bad words is counted in a few
milliseconds, off the event loop where its key is made. The constants are CPython 3.11's sizes (sys.getsizeof),
rounded up: an int in a tuple is its 8-byte slot and a 28-byte object, a one-item tuple 48 bytes, a log-probability
with 5 top ones ~2.3 KB; tests/unit/test_generation_cache_bytes.py checks the bound against the objects' real sizes."""

from __future__ import annotations

INT_BYTES = 36  # a token id in a tuple or list: the slot and the int
_WORD_BYTES = 64  # a bad word's own tuple and its slot in the outer one
_BIAS_BYTES = 128  # a (token id, bias) pair: the tuple, its int and float, the slot
_STR_BYTES = 64  # a string's header and its slot
_DELTA_BYTES = 256  # a Delta and its fixed fields
# one token's entry (runtime/generate_streams.py makes it: token_id, token, logprob, rank, top, bytes, top_bytes): the
# dict, its text, float and byte list; and a top entry: the (text, logprob, id) tuple, its text, float, byte list
_LOGPROB_BYTES = 640
_TOP_BYTES = 384


def params_bytes(p) -> int:
    """About what a SamplingParams' request-sized fields take (its scalar fields: a kilobyte)."""
    return (1024 + _WORD_BYTES * len(p.bad_words_ids) + INT_BYTES * sum(map(len, p.bad_words_ids))
            + _BIAS_BYTES * len(p.logit_bias) + INT_BYTES * (len(p.allowed_token_ids) + len(p.stop_token_ids))
            + sum(_STR_BYTES + len(s) for s in p.stop) + (_STR_BYTES + len(p.guide[1]) if p.guide else 0))


def _logprobs_bytes(entries) -> int:
    if not entries:
        return 0
    return sum(_LOGPROB_BYTES + _TOP_BYTES * len(e.get("top") or ()) if isinstance(e, dict) else _LOGPROB_BYTES
               for e in entries)


def deltas_bytes(deltas) -> int:
    """About what a generation's deltas take: text, token ids, log-probabilities of the output and the prompt."""
    return sum(_DELTA_BYTES + _STR_BYTES + len(d.text) + INT_BYTES * len(d.token_ids) + _logprobs_bytes(d.logprobs)
               + _logprobs_bytes(d.prompt_logprobs) for d in deltas)

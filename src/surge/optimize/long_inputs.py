"""The gate's long inputs: texts past the 128 tokens the calibration and held-out sets are cut at.

The shipped sentences are short queries, and the sets are tokenized at 128 tokens, while a served
request goes up to the model's max length (256 / 512). A candidate whose error shows only on longer
inputs (position embeddings past 128 rounded or broken, attention scores that overflow FP16 over
long rows) would be promoted without one such input measured. So the gate adds a small set of
texts built by joining held-out sentences, with lengths spread evenly from just past 128 tokens up
to the max length, tokenized at the max length. Small, because it is the costly part of the gate on
a 2-core machine (attention grows with the square of the length): LONG_SHARE of the held-out
sentences, between LONG_MIN and LONG_MAX texts.
"""

from __future__ import annotations

import numpy as np

from surge.models.hf import ModelSpec

SHORT = 128  # what the calibration / held-out sets are tokenized at (validate.encode_texts' default)
LONG_SHARE, LONG_MIN, LONG_MAX = 1 / 64, 8, 32


def long_texts(spec: ModelSpec, sentences: list[str], count: int | None = None, seed: int = 0) -> list[str]:
    """`count` texts (default: LONG_SHARE of `sentences`, within [LONG_MIN, LONG_MAX]) of joined
    sentences, the i-th reaching at least its target length in tokens (special tokens included), the
    targets spread evenly over (SHORT, spec.max_length]; [] when the model serves nothing past SHORT."""
    if spec.max_length <= SHORT or not sentences:
        return []
    from tokenizers import Tokenizer

    if count is None:
        count = int(np.clip(round(len(sentences) * LONG_SHARE), LONG_MIN, LONG_MAX))
    tok = Tokenizer.from_file(str(spec.tokenizer_file))
    tok.no_padding()
    tok.no_truncation()
    lengths = [len(e.ids) for e in tok.encode_batch(list(sentences), add_special_tokens=False)]
    if max(lengths) == 0:
        return []
    special = len(tok.encode("", add_special_tokens=True).ids)
    targets = np.linspace(SHORT + 1, spec.max_length, count).round().astype(int)
    order = np.random.default_rng(seed).permutation(len(sentences))
    out, k = [], 0
    for target in targets:
        parts, n = [], special
        while n < target:  # a small set is gone through again: the text still reaches its length
            i = int(order[k % len(order)])
            parts.append(sentences[i])
            n += lengths[i]
            k += 1
        out.append(" ".join(parts))
    return out

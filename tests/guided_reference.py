"""The reference for guided decoding: transformers' `generate` with a logits processor that keeps only the
tokens llguidance's own matcher allows (its numpy helpers fill and apply the mask), independent of
surge's sampler and its bit unpacking."""

from __future__ import annotations

import json
from pathlib import Path


def hf_guided(model, model_dir: Path, prompt: list[int], guide: tuple[str, str], max_new: int) -> list[int]:
    """Greedy tokens of `model` (a transformers causal LM) held to `guide`, ending at EOS (kept) or after
    max_new tokens."""
    import llguidance
    import llguidance.numpy as lln
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from surge.runtime.guided import grammar

    cfg = json.loads((model_dir / "config.json").read_text())
    vocab, eos = cfg["vocab_size"], cfg["eos_token_id"]
    tok = llguidance.LLTokenizer((model_dir / "tokenizer.json").read_text(), n_vocab=vocab, eos_token=eos)
    matcher = llguidance.LLMatcher(tok, grammar(guide), log_level=0)
    assert not matcher.is_error(), matcher.get_error()

    class Held(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > len(prompt):
                assert matcher.consume_token(int(input_ids[0, -1])), matcher.get_error()
            mask = lln.allocate_token_bitmask(1, vocab)
            lln.fill_next_token_bitmask(matcher, mask)
            logits = scores.float().numpy().copy()
            lln.apply_token_bitmask_inplace(logits, mask)
            return torch.from_numpy(logits)

    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, logits_processor=LogitsProcessorList([Held()]))
    return out[0, len(prompt):].tolist()

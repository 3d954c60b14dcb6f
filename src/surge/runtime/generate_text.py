"""The text side of a generate model: tokenizer, chat template, prompt checks.

Shared by the local GenerateService and the Ray ingress's stand-in for a remote one
(distributed/remote_generate.py), so both give the protocol layers the same answers
and the same errors without a round trip to the engine.
"""

from __future__ import annotations

from functools import cached_property

from surge.errors import InvalidInput

LONG_TEXT = 4096  # characters above which `encode` lets the GIL go while it works
LONG_IDS = 4096  # token ids above which `decode_text` lets the GIL go while it works
BATCH = 256  # texts an `encode_many` batch hands over at once


def _batch(tokenizer):
    """The tokenizer's encode_batch that lets the GIL go and keeps no offsets (tokenizers >= 0.20): freeing an
    Encoding with every token's offsets keeps the GIL ~40 ms for 500,000 tokens (a 2 MB chat), the event loop
    waiting; without them ~1 ms, and the encode itself is ~40% faster. The ids are the same."""
    return getattr(tokenizer, "encode_batch_fast", None) or tokenizer.encode_batch


def encode_text(tokenizer, text: str, special: bool = True) -> list[int]:
    """`tokenizer.encode(text).ids` (a tokenizers.Tokenizer): for a long text, so that the GIL is let go."""
    if len(text) > LONG_TEXT and tokenizer.padding is None:
        # tokenizers' encode keeps the GIL for the whole text (a 2 MB prompt: 1.5 s in which the event
        # loop, on its own thread, could not run); encode_batch lets it go while it works, same ids
        return _batch(tokenizer)([text], add_special_tokens=special)[0].ids
    return tokenizer.encode(text, add_special_tokens=special).ids


def decode_text(tokenizer, ids: list[int], skip_special: bool) -> str:
    """`tokenizer.decode(ids)`: for many ids, so that the GIL is let go (decode keeps it: 0.4 s for 4M ids;
    decode_batch, the same text, does not)."""
    if len(ids) > LONG_IDS:
        return tokenizer.decode_batch([ids], skip_special_tokens=skip_special)[0]
    return tokenizer.decode(ids, skip_special_tokens=skip_special)


class PromptText:
    """Needs `name`, `kind`, `tokenizer` (tokenizers.Tokenizer), `chat_template` (or None),
    `max_model_len`, `vocab_size` and `kserve_metadata(versions)`."""

    name: str
    max_model_len: int
    vocab_size: int

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        return encode_text(self.tokenizer, text, special)

    def encode_many(self, texts: list[str], *, special: bool = True) -> list[list[int]]:
        """`encode` of each text: in batches of BATCH, the GIL let go while each is encoded (as `encode`)
        and held only to hand a batch over (100,000 bad words in one encode_batch held it 0.7 s)."""
        if self.tokenizer.padding is not None:  # a batch would pad its texts to one length
            return [self.encode(t, special=special) for t in texts]
        out: list[list[int]] = []
        for k in range(0, len(texts), BATCH):
            out.extend(e.ids for e in _batch(self.tokenizer)(texts[k:k + BATCH], add_special_tokens=special))
        return out

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_all(self, ids: list[int]) -> str:
        """The text with the special tokens written out (a request's skip_special_tokens false)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def render_chat(self, messages: list[dict], **kwargs) -> str:
        if self.chat_template is None:
            raise InvalidInput(f"model '{self.name}' has no chat template; use /v1/completions", param="messages")
        return self.chat_template.render(messages, **kwargs)

    def check_prompt(self, ids: list[int], max_tokens: int | None = None) -> None:
        """`max_tokens`: what the request asked for itself (None: the server's default, which a long
        prompt cuts at the context's end); asked past the context it is refused, as OpenAI and vLLM
        refuse it, rather than answered shorter than asked with finish_reason "length"."""
        if not ids:
            raise InvalidInput("the prompt is empty", param="prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidInput(f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                               "tokens, prompt and output", param="prompt")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidInput(f"token ids must be in [0, {self.vocab_size})", param="prompt")
        if max_tokens is not None and len(ids) + max_tokens > self.max_model_len:
            raise InvalidInput(f"this model's context is {self.max_model_len} tokens; the request asked for "
                               f"{len(ids) + max_tokens} ({len(ids)} of prompt, {max_tokens} of output): lower "
                               "max_tokens or shorten the prompt", param="max_tokens")

    def check_guide(self, guide: tuple[str, str] | None, param: str = "response_format") -> None:
        """A structured-output guide (runtime/guided.py) that does not compile for this model's tokenizer is
        InvalidInput naming `param`; checked before the engine sees it."""
        if guide is not None:
            self._guides.check(guide, param)

    def guide_literal(self, text: str) -> str:
        """`text` as a Lark literal of this model's grammars (runtime.guided.Guides.literal)."""
        return self._guides.literal(text)

    @cached_property
    def _guides(self):
        """Built at the first guided request (the tokenizer's trie: ms to a second)."""
        from surge.runtime.guided import Guides

        return Guides(self.tokenizer.to_str(), self.vocab_size)

    def triton_config(self) -> dict:
        """Triton's ModelConfig (JSON form) of a generate model: the generate extension's tensors
        (only the fields surge's gRPC ModelConfig has, so HTTP and gRPC answer alike)."""
        meta = self.kserve_metadata([])
        device = meta["platform"].removeprefix("surge_").split(":")[0]
        return {"name": self.name, "platform": f"surge_{device}", "backend": "surge", "max_batch_size": 0,
                "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
                "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [1]}],
                "parameters": {"task": {"string_value": "generate"}, "kind": {"string_value": self.kind}}}

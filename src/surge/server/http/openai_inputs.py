"""What the OpenAI route checks beyond the request schema, shared with the hot path.

1. Token-id inputs. OpenAI's API accepts lists of token ids, and clients use it:
   LangChain's `OpenAIEmbeddings` tokenizes with tiktoken (cl100k) by default
   and sends the ids. Read as this model's own vocabulary they are meaningless
   (200 with garbage vectors), so by default they get a 400 that says what to
   change; `--allow-token-ids` accepts them as ids of the model's tokenizer.
2. Inputs longer than the model. OpenAI answers 400; so does surge, naming the
   input and its token count, unless the request (`"truncate": true`) or the
   server (`--auto-truncate`) asks for truncation. The check runs after the
   inputs were computed truncated (so cache keys and the cache-hit path stay
   what they are): only inputs that came out at the model's maximum length are
   counted again without truncation, which is rare and costs one tokenization.
"""

from __future__ import annotations

from surge.errors import InvalidInput

TOKEN_IDS_HINT = (
    "this server expects text: 'input' holds token ids, and ids made by another tokenizer (LangChain's "
    "OpenAIEmbeddings tokenizes with tiktoken by default) mean nothing to model '{model}'. Send the texts "
    "themselves; with LangChain set OpenAIEmbeddings(check_embedding_ctx_length=False). A server started with "
    "--allow-token-ids accepts ids of the model's own tokenizer."
)


def check_token_ids(ids: list[list[int]] | None, model: str, allowed: bool, max_length: int | None,
                    truncate: bool) -> None:
    if ids is None:
        return
    if not allowed:
        raise InvalidInput(TOKEN_IDS_HINT.format(model=model), param="input")
    if max_length and not truncate:
        for i, seq in enumerate(ids):
            if len(seq) > max_length:
                raise InvalidInput(_too_long(i, len(seq), max_length, model), param="input")


def _too_long(index: int, count: int, max_length: int, model: str) -> str:
    return (f"input {index} has {count} tokens, more than the maximum of {max_length} of model '{model}'; "
            "shorten it, or ask for truncation with \"truncate\": true (or start the server with --auto-truncate)")


def suspects(service, result) -> list[int]:
    """Inputs that came out at the model's maximum length: perhaps truncated."""
    max_length = getattr(service, "max_length", None)
    counts = getattr(result, "tokens", None)
    if not max_length or not counts:
        return []
    return [i for i, n in enumerate(counts) if n >= max_length]


async def check_lengths(service, texts: list[str] | None, result) -> None:
    """400 for the first text longer than the model (call when truncation was not asked for)."""
    if texts is None:
        return
    maybe = suspects(service, result)
    counter = getattr(service, "count_tokens", None)  # remote (Ray) models lack it: they truncate
    if not maybe or counter is None:
        return
    full = await counter([texts[i] for i in maybe])
    for i, n in zip(maybe, full):
        if n > service.max_length:
            raise InvalidInput(_too_long(i, n, service.max_length, service.name), param="input")

"""Each token's own bytes, for OpenAI's `bytes` of a log-probability: a token holding part of a UTF-8
character decodes to U+FFFD alone, and the field exists so that a client can join such tokens back into
characters (the decoded text's bytes cannot).

Byte-level BPE (GPT-2, Llama 3, Qwen2) writes each byte as one printable character; SentencePiece with byte
fallback (Llama 2, Mistral) writes a lone byte as `<0xNN>` and a space as U+2581. Special tokens have no bytes
of their own here: their entry is None and the caller uses the text it shows for them.

(llguidance's LLTokenizer.decode_bytes, which guided decoding already builds, reads the same pieces but
cannot give the lone byte 0xFF: that byte marks its special tokens, so the token of byte 0xFF comes back as a
special token with no bytes.)
"""

from __future__ import annotations

import json
import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes for
    the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in set(printable)]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


def token_bytes_table(tokenizer) -> list[bytes | None]:
    """tokenizers.Tokenizer -> the bytes of every token id (None: special, or not known)."""
    spec = json.loads(tokenizer.to_str())
    byte_level = "ByteLevel" in json.dumps(spec.get("decoder"))
    special = {t["id"] for t in spec.get("added_tokens") or () if t.get("special")}
    alphabet = _byte_of_char()
    out: list[bytes | None] = [None] * tokenizer.get_vocab_size(with_added_tokens=True)
    for piece, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if i in special or i >= len(out):
            continue
        if byte_level:
            if all(c in alphabet for c in piece):
                out[i] = bytes(alphabet[c] for c in piece)
        elif (m := _BYTE_PIECE.fullmatch(piece)) is not None:
            out[i] = bytes([int(m.group(1), 16)])
        else:
            out[i] = piece.replace("\u2581", " ").encode()
    return out

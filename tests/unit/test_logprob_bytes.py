"""OpenAI's `bytes` of a token's log-probability are the token's own bytes, so that a client can join tokens
that each carry part of a character (OpenAI's reason for the field). A token holding half of "é" decodes to
U+FFFD alone; its bytes were those of U+FFFD ([239, 191, 189]) and the joined bytes were not the text."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")

from prometheus_client import CollectorRegistry  # noqa: E402

from surge.runtime.scheduler import SamplingParams  # noqa: E402
from tests.decoder_models import build_model  # noqa: E402


def test_bytes_of_tokens_that_split_characters_join_into_the_text(tmp_path):
    from tokenizers import Tokenizer

    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerateService, GenerationConfig
    from surge.server.http.responses_items import logprob_list

    path = build_model("qwen2", tmp_path / "q", seed=3, all_bytes=True)
    torch.set_num_threads(1)
    engine = DecoderEngine(path, num_blocks=64, block_size=4, max_num_seqs=2, max_model_len=64)
    config = GenerationConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, cache_entries=0)
    service = GenerateService("m", "1", path, engine, Tokenizer.from_file(str(path / "tokenizer.json")), None,
                              config, request_timeout_s=60, metrics_registry=CollectorRegistry())
    service.mark_ready()
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, logprobs=2,
                            guide=("regex", "(é|日本|😀){3}"))
    eos = service.engine.cfg.eos_token_ids[0]
    # a special token's bytes are those of the text it shows ("" where special tokens are skipped)
    ends = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=0, logit_bias=((eos, 100.0),))
    # ... and its own text where the request writes special tokens out (skip_special_tokens false)
    shown = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=1, logit_bias=((eos, 100.0),),
                           skip_special_tokens=False)

    async def main():
        try:
            return (await service.generate(service.encode("hi"), params),
                    await service.generate(service.encode("hi"), ends),
                    await service.generate(service.encode("hi"), shown))
        finally:
            await service.close()

    res, special, written = asyncio.run(main())
    assert [(it["token"], it["bytes"]) for it in logprob_list(special.logprobs)] == [("", [])] * 2
    eos_text = service.tokenizer.decode([eos], skip_special_tokens=False)
    assert eos_text and written.text == eos_text * 2
    items = logprob_list(written.logprobs)
    assert [(it["token"], bytes(it["bytes"])) for it in items] == [(eos_text, eos_text.encode())] * 2
    items = logprob_list(res.logprobs)
    assert len(res.text) == 3 and len(items) > 3, (res.text, items)  # some character took several tokens
    assert b"".join(bytes(it["bytes"]) for it in items) == res.text.encode()
    for it, lp in zip(items, res.logprobs):
        for top, (_, _, token_id) in zip(it["top_logprobs"], lp["top"]):
            assert bytes(top["bytes"]) == _token_bytes(service.tokenizer, token_id)


def _token_bytes(tokenizer, token_id: int) -> bytes:
    """A byte-level BPE token's bytes, from GPT-2's printable mapping of the 256 bytes (the reference)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    char_to_byte = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(rest)}
    return bytes(char_to_byte[c] for c in tokenizer.id_to_token(token_id))


def test_sentencepiece_byte_fallback_pieces_are_their_bytes():
    """Llama 2 / Mistral style: a lone byte is the piece <0xNN>, a space U+2581; special tokens have none."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from surge.runtime.token_bytes import token_bytes_table

    vocab = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581hi": 3, "a": 4}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    table = token_bytes_table(tok)
    assert table[1] + table[2] == "é".encode() and table[3] == b" hi" and table[4] == b"a"
    assert table[tok.token_to_id("</s>")] is None
    assert tok.decode([1]) != "é"  # alone, half a character: its text cannot give its byte

"""A checkpoint's generation_config.json may name end-of-sequence tokens that config.json does not (Llama 3
Instruct: config.json 128001, generation_config.json [128001, 128008, 128009], <|eot_id|> ending every chat
turn). transformers' `generate` stops at generation_config's; vLLM adds them to the stop tokens. Without them the
answer ran past the end of its turn."""

from __future__ import annotations

import asyncio
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.decoder_models import build_model  # noqa: E402


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_generation_stops_at_generation_configs_eos_as_transformers_does(tmp_path, kind):
    from tokenizers import Tokenizer

    from surge.engines.decoder import DecoderEngine
    from surge.models.decoder import load_decoder_config
    from surge.runtime.generate_service import GenerateService, GenerationConfig
    from surge.runtime.scheduler import SamplingParams

    path = build_model(kind, tmp_path / kind, seed=6)
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompt = [5, 17, 33, 8, 41, 12]
    with torch.no_grad():
        free = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    base = load_decoder_config(path).eos_token_ids
    extra = next(t for t in free[3:] if t not in base)  # a token the free answer writes, made an end token
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["eos_token_id"] = [*base, extra]
    gen_path.write_text(json.dumps(gen))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                            pad_token_id=0)[0, len(prompt):].tolist()
    assert want[-1] == extra and len(want) < 12, want  # transformers stopped at it

    assert extra in load_decoder_config(path).eos_token_ids
    engine = DecoderEngine(path, num_blocks=64, block_size=4, max_num_seqs=2, max_model_len=64)
    config = GenerationConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, cache_entries=0)
    service = GenerateService("m", "1", path, engine, Tokenizer.from_file(str(path / "tokenizer.json")), None,
                              config, request_timeout_s=60)
    service.mark_ready()
    try:
        res = asyncio.run(service.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    finally:
        asyncio.run(service.close())
    assert list(res.token_ids) == want and res.finish_reason == "stop"

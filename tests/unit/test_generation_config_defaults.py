"""A model's generation_config.json sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty)
apply to a request that leaves them unset, as vLLM's `--generation-config auto` (its default) and transformers'
`generate` apply them (Qwen2.5-Instruct ships temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05);
`generation_config=none` keeps OpenAI's defaults. A value the request gives wins."""

from __future__ import annotations

import asyncio
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from prometheus_client import CollectorRegistry  # noqa: E402

from tests.decoder_models import build_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = build_model("qwen2", tmp_path_factory.mktemp("m") / "q", seed=3)
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    # top_k 1: sampling with the model's defaults is greedy decoding, which transformers' generate checks
    gen.update({"do_sample": True, "temperature": 0.7, "top_k": 1, "top_p": 0.8, "repetition_penalty": 1.05})
    gen_path.write_text(json.dumps(gen))
    return path


def _service(path, **gen):
    from tokenizers import Tokenizer

    from surge.config import GenerationConfig
    from surge.engines.decoder import DecoderEngine
    from surge.runtime.generate_service import GenerateService

    torch.set_num_threads(1)
    engine = DecoderEngine(path, num_blocks=64, block_size=4, max_num_seqs=2, max_model_len=64)
    config = GenerationConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, cache_entries=0, **gen)
    s = GenerateService("m", "1", path, engine, Tokenizer.from_file(str(path / "tokenizer.json")), None, config,
                        request_timeout_s=60, metrics_registry=CollectorRegistry())
    s.mark_ready()
    return s


def test_unset_sampling_fields_take_the_models_generation_config(model_dir):
    from surge.server.http.generate_common import make_params

    service = _service(model_dir)
    try:
        p = make_params(service, max_tokens=8, temperature=None, top_p=None)
        assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (0.7, 1, 0.8, 1.05)
        own = make_params(service, max_tokens=8, temperature=1.2, top_p=0.9, top_k=0, repetition_penalty=1.0)
        assert (own.temperature, own.top_k, own.top_p, own.repetition_penalty) == (1.2, 0, 0.9, 1.0)
        prompt = [5, 17, 33, 8, 41, 12]
        got = asyncio.run(service.generate(prompt, p)).token_ids
    finally:
        asyncio.run(service.close())
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # transformers' generate with the same generation_config.json: its defaults too
        want = model.generate(torch.tensor([prompt]), max_new_tokens=8, pad_token_id=0)[0, len(prompt):].tolist()
    assert list(got) == want[:len(got)] and len(got) >= 1


def test_generation_config_none_keeps_openais_defaults(model_dir):
    from surge.server.http.generate_common import make_params

    service = _service(model_dir, generation_config="none")
    try:
        p = make_params(service, max_tokens=8, temperature=None, top_p=None)
    finally:
        asyncio.run(service.close())
    assert (p.temperature, p.top_k, p.top_p, p.repetition_penalty) == (1.0, 0, 1.0, 1.0)

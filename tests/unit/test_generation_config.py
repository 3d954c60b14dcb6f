"""config.GenerationConfig: its sources (SURGE_GENERATION_<FIELD>, --generation FIELD=VALUE), the merge
of a model.yaml section over the server's settings, and the fields left to the engine's settings."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from surge.config import EngineConfig, GenerationConfig, ModelFile


def test_environment_then_flag_pairs():
    env = {"SURGE_GENERATION_KV_CACHE_TOKENS": "4096", "SURGE_GENERATION_PREFIX_CACHING": "false",
           "SURGE_GENERATION_MAX_WAITING": "10", "SURGE_GENERATION_MAX_MODEL_LEN": "none", "OTHER": "1"}
    got = GenerationConfig.from_sources(["max_waiting=3,cuda-graphs=off", "default_max_tokens=7"], env=env)
    assert (got.kv_cache_tokens, got.prefix_caching, got.max_waiting, got.cuda_graphs, got.default_max_tokens) \
        == (4096, False, 3, False, 7)
    assert got.max_model_len is None and got.model_fields_set == {
        "kv_cache_tokens", "prefix_caching", "max_waiting", "max_model_len", "cuda_graphs", "default_max_tokens"}
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        GenerationConfig.from_sources(["kv_blocks=4"], env={})
    with pytest.raises(ValidationError, match="max_num_seqs"):
        GenerationConfig.from_sources(["max_num_seqs=0"], env={})
    with pytest.raises(ValidationError, match="block_size"):
        GenerationConfig.from_sources([], env={"SURGE_GENERATION_BLOCK_SIZE": "sixteen"})


def test_a_model_section_overrides_only_the_fields_it_sets():
    server = GenerationConfig(max_waiting=3, default_max_tokens=9)
    section = ModelFile.model_validate({"generation": {"default_max_tokens": 5}}).generation
    merged = server.merged(section)
    assert (merged.max_waiting, merged.default_max_tokens, merged.block_size) == (3, 5, 16)
    assert server.merged(None) is server
    with pytest.raises(ValidationError, match="extra"):
        ModelFile.model_validate({"generation": {"kv_blocks": 4}})


def test_running_sequences_and_context_default_to_the_engine_settings():
    engine = EngineConfig(max_batch_size=8, max_seq_len=128)
    assert (GenerationConfig().resolved(engine).max_num_seqs, GenerationConfig().resolved(engine).max_model_len) \
        == (8, 128)
    own = GenerationConfig(max_num_seqs=4, max_model_len=64).resolved(engine)
    assert (own.max_num_seqs, own.max_model_len) == (4, 64)
    assert GenerationConfig().resolved().max_num_seqs == EngineConfig().max_batch_size


def test_the_reasoning_parser_from_every_source():
    assert GenerationConfig().reasoning_parser == "none"
    assert GenerationConfig.from_sources(["reasoning_parser=deepseek_r1"], env={}).reasoning_parser == "deepseek_r1"
    assert GenerationConfig.from_sources([], env={"SURGE_GENERATION_REASONING_PARSER": "qwen3"}).reasoning_parser \
        == "qwen3"
    section = ModelFile.model_validate({"generation": {"reasoning_parser": "qwen3"}}).generation
    assert GenerationConfig(reasoning_parser="deepseek_r1").merged(section).reasoning_parser == "qwen3"
    with pytest.raises(ValidationError, match="reasoning_parser"):
        GenerationConfig.from_sources(["reasoning_parser=granite"], env={})


def test_an_unknown_generation_variable_is_an_error_naming_it_and_the_fields():
    """A misspelled SURGE_GENERATION_<FIELD> was ignored while a bad --generation field is an error."""
    with pytest.raises(ValueError, match="SURGE_GENERATION_KV_CACHE_TOKEN:.*kv_cache_tokens"):
        GenerationConfig.from_sources([], env={"SURGE_GENERATION_KV_CACHE_TOKEN": "4096"})
    with pytest.raises(ValueError, match="SURGE_GENERATION_max_waiting"):  # the variables are in capitals
        GenerationConfig.from_sources([], env={"SURGE_GENERATION_max_waiting": "3"})
    assert GenerationConfig.from_sources([], env={"SURGE_GENERATIONS": "1", "SURGE_GENERATION_MAX_WAITING": "3"}) \
        .max_waiting == 3

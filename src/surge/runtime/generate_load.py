"""A decoder directory -> a GenerateService: the engine's settings, the engine (in a process of its own by
default, or on a thread), the tokenizer and the chat template."""

from __future__ import annotations

from pathlib import Path

from surge.config import GenerationConfig
from surge.runtime.generate_process import EngineProcess
from surge.runtime.generate_service import GenerateService


def decoder_engine_kwargs(config: GenerationConfig, device: str, precision: str | None) -> dict:
    """DecoderEngine's keyword arguments (less the path and threads) for these settings."""
    dtype = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "auto": None, None: None}.get(precision, precision)
    return dict(device=device, dtype=dtype, block_size=config.block_size, kv_cache_tokens=config.kv_cache_tokens,
                max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                cuda_graphs=config.cuda_graphs, graph_prefill_tokens=config.graph_prefill_tokens,
                decode_steps=config.decode_steps,
                decode_launch_ms=config.decode_launch_ms, max_loras=config.max_loras or 0,
                max_lora_rank=config.max_lora_rank, speculative_tokens=config.speculative_tokens,
                speculative_model=config.speculative_model, quantization=config.quantization,
                cpu_weight_layout=config.cpu_weight_layout, fp8_activations=config.fp8_activations)


def service_over(engine, path: Path, name: str, version: str, config: GenerationConfig,
                 request_timeout_s: float = 30.0) -> GenerateService:
    """A GenerateService on `engine` (a DecoderEngine, an EngineProcess or a HubClient) with the
    directory's tokenizer and chat template."""
    from tokenizers import Tokenizer

    from surge.models.chat_template import ChatTemplate

    tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return GenerateService(name, version, path, engine, tokenizer, ChatTemplate.from_dir(path), config,
                           request_timeout_s=request_timeout_s)


def load_generate_service(path: Path, name: str, version: str = "1", *, device: str = "cpu",
                          precision: str | None = None, threads: int = 0, config: GenerationConfig | None = None,
                          request_timeout_s: float = 30.0) -> GenerateService:
    """A decoder directory -> a warmed-up GenerateService (the caller marks it ready)."""
    from surge.errors import ConfigError

    config = (config or GenerationConfig()).resolved()
    path = Path(path)
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(f"{path}: tokenizer.json missing (a fast tokenizer file is required)")
    kwargs = decoder_engine_kwargs(config, device, precision)
    # default on: on a GPU the loop and the event loop never wait for each other's GIL; on the CPU the engine's
    # OpenMP team is the process's only one (a team on a thread beside the main thread's counts more OpenMP
    # threads than cores, and libgomp then stops spinning between parallel regions: a GPT-2 small step in BF16
    # on 2 cores 1.25x slower on a thread, benchmarks/cpu_engine_thread.py; through `surge serve` 151 against
    # 177 tok/s, benchmarks/generate_http.py, docs/benchmarks/generate.md session 34)
    remote = config.engine_process if config.engine_process is not None else True
    if remote:
        engine = EngineProcess(path, kwargs, config, name, threads=threads)
    else:
        from surge.engines.decoder import DecoderEngine

        engine = DecoderEngine(path, threads=threads, **kwargs)
        engine.warmup()
    return service_over(engine, path, name, version, config, request_timeout_s)

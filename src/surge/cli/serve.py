"""`surge serve`: serve the bundled model, a model directory or a model repository."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import List, Optional

import typer

from surge.config import (BatchingConfig, CacheConfig, EngineConfig, GenerationConfig, LimitsConfig, MetricsConfig,
                          ServerConfig, default_cache_dir)


def _default(model, field: str):
    """A flag's default is the config field's: written once, in config.py."""
    return model.model_fields[field].default


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def serve(
    model_dir: Optional[Path] = typer.Argument(None, envvar="SURGE_MODEL_DIR", help="Hugging Face model directory (default: the bundled all-MiniLM-L6-v2), or a tensor model file: .onnx, .pt2 (torch.export) or model.py."),
    artifact: Optional[Path] = typer.Option(None, "--artifact", envvar="SURGE_ARTIFACT", help="Serve an artifact written by `surge optimize` (instead of MODEL_DIR)."),
    host: str = typer.Option("127.0.0.1", envvar="SURGE_HOST", help="Address to bind."),
    port: int = typer.Option(8000, envvar="SURGE_PORT", help="HTTP port."),
    grpc_port: int = typer.Option(8001, envvar="SURGE_GRPC_PORT", help="gRPC port (KServe v2); 0 disables gRPC."),
    threads: int = typer.Option(0, envvar="SURGE_THREADS", help="Intra-op threads of a CPU engine: ONNX Runtime per instance, torch (--device cpu) per process (0: all cores)."),
    instances: int = typer.Option(1, envvar="SURGE_INSTANCES", help="Engine copies run concurrently."),
    model_name: Optional[str] = typer.Option(None, envvar="SURGE_MODEL_NAME", help="Name to serve the model under."),
    served_model_name: Optional[List[str]] = typer.Option(None, envvar="SURGE_SERVED_MODEL_NAME", help="More names the model answers to, e.g. text-embedding-3-small (comma-separated and/or repeated)."),
    auto_truncate: bool = typer.Option(_default(LimitsConfig, "auto_truncate"), "--auto-truncate", envvar="SURGE_AUTO_TRUNCATE", help="OpenAI route: cut inputs longer than the model instead of answering 400."),
    allow_token_ids: bool = typer.Option(_default(LimitsConfig, "allow_token_ids"), "--allow-token-ids", envvar="SURGE_ALLOW_TOKEN_IDS", help="OpenAI route: accept token-id inputs (as ids of the model's own tokenizer)."),
    metrics_public: bool = typer.Option(_default(MetricsConfig, "public"), "--metrics-public", envvar="SURGE_METRICS_PUBLIC", help="Serve /metrics without the API key."),
    metrics_port: Optional[int] = typer.Option(_default(MetricsConfig, "port"), envvar="SURGE_METRICS_PORT", help="Also serve the metrics on this port (no API key)."),
    model_repository: Optional[Path] = typer.Option(None, envvar="SURGE_MODEL_REPOSITORY", help="Directory of models/<name>/<version>/model.yaml."),
    repository_poll_s: Optional[float] = typer.Option(None, envvar="SURGE_REPOSITORY_POLL_S", help="Rescan the model repository every N seconds (new versions, changed model.yaml)."),
    engine: str = typer.Option("onnxrt", envvar="SURGE_ENGINE", help="onnxrt (CPU) or torch (GPU, or its CPU path with --device cpu; --precision bf16 uses AMX GEMMs)."),
    device: str = typer.Option("cpu", envvar="SURGE_DEVICE", help="cpu or cuda[:N] (torch engine)."),
    precision: str = typer.Option("fp32", envvar="SURGE_PRECISION", help="fp32, fp16, bf16 (torch engine; on the CPU fp32 or bf16)."),
    devices: Optional[str] = typer.Option(None, envvar="SURGE_DEVICES", help="CUDA ordinals, e.g. 0,1: one replica per GPU (torch engine)."),
    tensor_parallel: int = typer.Option(1, envvar="SURGE_TENSOR_PARALLEL", help="Split one model over this many ranks (torch engine)."),
    api_key: Optional[str] = typer.Option(None, envvar="SURGE_API_KEY", help="Require 'Authorization: Bearer KEY' on every route but health checks."),
    max_batch_size: int = typer.Option(64, envvar="SURGE_MAX_BATCH_SIZE", help="Most inputs in one engine batch."),
    max_batch_tokens: int = typer.Option(8192, envvar="SURGE_MAX_BATCH_TOKENS", help="Token budget of one batch."),
    max_queue_delay_ms: float = typer.Option(2.0, envvar="SURGE_MAX_QUEUE_DELAY_MS", help="Longest wait for a batch to fill."),
    max_queue_size: int = typer.Option(2048, envvar="SURGE_MAX_QUEUE_SIZE", help="Queued inputs above which requests get 429."),
    no_batching: bool = typer.Option(False, "--no-batching", envvar="SURGE_NO_BATCHING", help="Run every request alone."),
    cache_bytes: int = typer.Option(64 * 1024 * 1024, envvar="SURGE_CACHE_BYTES", help="Byte bound of the recent cache tier (0 disables the cache)."),
    cache_pinned: int = typer.Option(0, envvar="SURGE_CACHE_PINNED", help="Size of the pinned hot tier."),
    cache_query_log: Optional[Path] = typer.Option(None, envvar="SURGE_CACHE_QUERY_LOG", help="Query log that seeds the pinned tier."),
    cache_policy: str = typer.Option("tinylfu", envvar="SURGE_CACHE_POLICY", help="Recent cache tier: lru or tinylfu (LRU with TinyLFU admission)."),
    redis_url: Optional[str] = typer.Option(None, envvar="SURGE_REDIS_URL", help="Shared cache tier on Redis."),
    max_inputs: int = typer.Option(_default(LimitsConfig, "max_inputs_per_request"), envvar="SURGE_MAX_INPUTS", help="Most inputs in one request."),
    max_body_bytes: int = typer.Option(2 * 1024 * 1024, envvar="SURGE_MAX_BODY_BYTES", help="Largest request body."),
    request_timeout_s: float = typer.Option(30.0, envvar="SURGE_REQUEST_TIMEOUT_S", help="Requests unanswered after this get 504."),
    cache_dir: Optional[Path] = typer.Option(None, envvar="SURGE_CACHE_DIR", help="Where exported artifacts are kept."),
    task: Optional[str] = typer.Option(None, envvar="SURGE_TASK", help="Override the task detected from the model directory: embed, classify, rerank, token-classify."),
    tei_embed: bool = typer.Option(False, "--tei-embed", envvar="SURGE_TEI_EMBED", help="POST /embed answers TEI's bare array of vectors."),
    log_level: str = typer.Option("info", envvar="SURGE_LOG_LEVEL", help="Log level."),
    workers: Optional[int] = typer.Option(None, envvar="SURGE_WORKERS", help="Front-end processes in front of the engine process(es) (1: one process; 0: one per core; default: from the core count where the mode supports it)."),
    engine_processes: Optional[int] = typer.Option(None, envvar="SURGE_ENGINE_PROCESSES", help="Under --workers: engine processes sharing the device(s); front end i talks to engine process i mod N (default: 2 with 8 or more front ends, else 1)."),
    generation: Optional[List[str]] = typer.Option(None, "--generation", help="Decoder models: FIELD=VALUE settings (comma-separated and/or repeated; fields: " + ", ".join(GenerationConfig.model_fields) + "); also SURGE_GENERATION_<FIELD>; a model.yaml's generation section overrides them."),
    ray: bool = typer.Option(False, "--ray", envvar="SURGE_RAY", help="Scale out on Ray Serve: each model is a deployment whose replicas each run a surge engine, batcher and cache (needs the `ray` extra)."),
    ray_address: Optional[str] = typer.Option(None, envvar="SURGE_RAY_ADDRESS", help="Ray cluster to deploy on (e.g. auto, ray://head:10001); default: start a local Ray instance."),
    ray_replicas: Optional[int] = typer.Option(None, envvar="SURGE_RAY_REPLICAS", help="Fixed replicas per model (default 1, or model.yaml's ray section)."),
    ray_min_replicas: Optional[int] = typer.Option(None, envvar="SURGE_RAY_MIN_REPLICAS", help="Autoscaling: fewest replicas."),
    ray_max_replicas: Optional[int] = typer.Option(None, envvar="SURGE_RAY_MAX_REPLICAS", help="Autoscaling: most replicas."),
    ray_target_ongoing: Optional[float] = typer.Option(None, envvar="SURGE_RAY_TARGET_ONGOING", help="Autoscaling: ongoing requests per replica to aim for."),
    ray_num_cpus: Optional[float] = typer.Option(None, envvar="SURGE_RAY_NUM_CPUS", help="CPUs per replica (fractions allowed; default 1)."),
    ray_num_gpus: Optional[float] = typer.Option(None, envvar="SURGE_RAY_NUM_GPUS", help="GPUs per replica (fractions allowed; default 0)."),
    ray_max_ongoing: Optional[int] = typer.Option(None, envvar="SURGE_RAY_MAX_ONGOING", help="Requests one replica takes at a time (default 64)."),
) -> None:
    """Serve models over HTTP (OpenAI-compatible, native, KServe v2) and gRPC."""
    if artifact is not None:
        from surge.cli.bootstrap import is_artifact_dir

        if model_dir is not None or not is_artifact_dir(artifact):
            raise typer.BadParameter("--artifact takes a directory written by `surge optimize`, and no MODEL_DIR")
        # The artifact carries its tokenizer and config: it is a model directory
        # whose ONNX file the engine loads as it is (see bootstrap.resolve_artifact).
        model_dir = artifact
        if model_name is None:
            import json

            model_name = json.loads((artifact / "manifest.json").read_text()).get("model_name")
    try:
        generation_config = GenerationConfig.from_sources(generation)
    except ValueError as exc:  # pydantic's ValidationError included
        raise typer.BadParameter(str(exc).replace("GenerationConfig", "generation settings"), param_hint="--generation")
    config = ServerConfig(
        host=host,
        port=port,
        grpc_port=grpc_port or None,
        api_key=api_key or None,
        model_dir=model_dir,
        model_name=model_name,
        served_model_names=[n.strip() for v in served_model_name or [] for n in v.split(",") if n.strip()],
        model_repository=model_repository,
        repository_poll_s=repository_poll_s or None,
        cache_dir=cache_dir,
        log_level=log_level,
        task=task,
        tei_embed=tei_embed,
        workers=workers,
        engine_processes=engine_processes,
        engine=EngineConfig(engine=engine, device=device, precision=precision, threads=threads, instances=instances,
                            max_batch_size=max_batch_size, tensor_parallel=tensor_parallel,
                            devices=[int(d) for d in devices.split(",")] if devices else None),
        batching=BatchingConfig(enabled=not no_batching, max_batch_size=max_batch_size,
                                max_batch_tokens=max_batch_tokens, max_queue_delay_ms=max_queue_delay_ms,
                                max_queue_size=max_queue_size),
        cache=CacheConfig(enabled=cache_bytes > 0 or cache_pinned > 0, max_bytes=cache_bytes,
                          pinned_top_k=cache_pinned, query_log=cache_query_log, redis_url=redis_url,
                          recent_policy=cache_policy),
        limits=LimitsConfig(max_inputs_per_request=max_inputs, max_body_bytes=max_body_bytes,
                            request_timeout_s=request_timeout_s, auto_truncate=auto_truncate,
                            allow_token_ids=allow_token_ids),
        metrics=MetricsConfig(public=metrics_public, port=metrics_port),
        generation=generation_config,
    )
    if ray or ray_address:
        # Ray is an optional extra: imported only here, only under --ray.
        from surge.cli.bootstrap import resolve_artifact
        from surge.distributed.config import flag_overrides
        from surge.errors import SurgeError

        try:
            overrides = flag_overrides(replicas=ray_replicas, min_replicas=ray_min_replicas,
                                       max_replicas=ray_max_replicas, target_ongoing=ray_target_ongoing,
                                       num_cpus=ray_num_cpus, num_gpus=ray_num_gpus, max_ongoing=ray_max_ongoing)
            try:
                from surge.distributed.launch import serve_on_ray
            except ImportError as exc:
                raise typer.BadParameter(f"needs Ray Serve: pip install 'surge[ray]' ({exc})", param_hint="--ray")
            serve_on_ray(config, address=ray_address, overrides=overrides, resolve=resolve_artifact)
        except SurgeError as exc:
            typer.echo(f"surge: {exc.message}", err=True)
            raise typer.Exit(code=2)
        return
    from surge.cli.workers import resolve_workers, serve_workers

    workers = resolve_workers(config)
    if workers != 1:
        if config.model_repository is not None:
            raise typer.BadParameter("--workers serves one model (no --model-repository yet)", param_hint="--workers")
        raise typer.Exit(code=serve_workers(config, workers))
    run_server(config)


def run_server(config: ServerConfig) -> None:
    import uvicorn

    from surge.server.app import create_app
    from surge.cli.bootstrap import build_state

    state = build_state(config)
    app = create_app(state)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False,
                loop="auto", http="auto", timeout_graceful_shutdown=10)
    if state.extras.get("startup_error"):
        raise typer.Exit(code=1)

"""`surge serve`: serve the bundled model, a model directory or a model repository."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import List, Optional

import typer

from surge.cli.options import build_config, env_fallbacks, with_config_options
from surge.config import GenerationConfig, ServerConfig


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)


def _param(name: str, default, *, kind=Optional[str]) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)


# Options that are no ServerConfig field; every other option is derived from config.py (cli/options.py).
EXTRA = [
    inspect.Parameter("model_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[Path], default=typer.Argument(
        None, envvar="SURGE_MODEL_DIR", metavar="MODEL_DIR", help="Hugging Face model directory (default: the bundled all-MiniLM-L6-v2), "
        "or a tensor model file: .onnx, .pt2 (torch.export) or model.py. A model.yaml in it (or beside the file) "
        "is read; the flags and SURGE_* variables that are set override its fields.")),
    _param("artifact", typer.Option(None, "--artifact", envvar="SURGE_ARTIFACT", help="Serve an artifact written "
           "by `surge optimize` (instead of MODEL_DIR)."), kind=Optional[Path]),
    _param("generation", typer.Option(None, "--generation", help="Decoder models: FIELD=VALUE settings "
           "(comma-separated and/or repeated; fields: " + ", ".join(GenerationConfig.model_fields) + "); also "
           "SURGE_GENERATION_<FIELD>; a repository model.yaml's generation section overrides them."),
           kind=Optional[List[str]]),
    _param("lora_modules", typer.Option(None, "--lora-modules", help="LoRA adapters of the decoder model, each "
           "served under its own model name: NAME=PATH of a PEFT directory, or vLLM's JSON {\"name\": ..., "
           "\"path\": ...} (repeated for more; the generation setting lora_modules)."), kind=Optional[List[str]]),
    _param("ray", typer.Option(False, "--ray", envvar="SURGE_RAY", help="Scale out on Ray Serve: each model is a "
           "deployment whose replicas each run a surge engine, batcher and cache (needs the `ray` extra)."), kind=bool),
    _param("ray_address", typer.Option(None, envvar="SURGE_RAY_ADDRESS", help="Ray cluster to deploy on (e.g. auto, "
           "ray://head:10001); default: start a local Ray instance.")),
    _param("ray_replicas", typer.Option(None, envvar="SURGE_RAY_REPLICAS", help="Fixed replicas per model "
           "(default 1, or model.yaml's ray section)."), kind=Optional[int]),
    _param("ray_min_replicas", typer.Option(None, envvar="SURGE_RAY_MIN_REPLICAS", help="Autoscaling: fewest "
           "replicas."), kind=Optional[int]),
    _param("ray_max_replicas", typer.Option(None, envvar="SURGE_RAY_MAX_REPLICAS", help="Autoscaling: most "
           "replicas."), kind=Optional[int]),
    _param("ray_target_ongoing", typer.Option(None, envvar="SURGE_RAY_TARGET_ONGOING", help="Autoscaling: ongoing "
           "requests per replica to aim for."), kind=Optional[float]),
    _param("ray_num_cpus", typer.Option(None, envvar="SURGE_RAY_NUM_CPUS", help="CPUs per replica (fractions "
           "allowed; default 1)."), kind=Optional[float]),
    _param("ray_num_gpus", typer.Option(None, envvar="SURGE_RAY_NUM_GPUS", help="GPUs per replica (fractions "
           "allowed; default 0)."), kind=Optional[float]),
    _param("ray_max_ongoing", typer.Option(None, envvar="SURGE_RAY_MAX_ONGOING", help="Requests one replica takes "
           "at a time (default 64)."), kind=Optional[int]),
]


@with_config_options(EXTRA)
def serve(config_values, model_dir: Optional[Path] = None, artifact: Optional[Path] = None, generation=None,
          lora_modules=None, ray: bool = False, ray_address=None, ray_replicas=None, ray_min_replicas=None, ray_max_replicas=None,
          ray_target_ongoing=None, ray_num_cpus=None, ray_num_gpus=None, ray_max_ongoing=None) -> None:
    """Serve models over HTTP (OpenAI-compatible, native, KServe v2) and gRPC."""
    values, given = config_values
    env_fallbacks(values, given)
    more: dict = {}
    if artifact is not None:
        from surge.cli.bootstrap import is_artifact_dir

        if model_dir is not None or not is_artifact_dir(artifact):
            raise typer.BadParameter("--artifact takes a directory written by `surge optimize`, and no MODEL_DIR")
        # The artifact carries its tokenizer and config: it is a model directory
        # whose ONNX file the engine loads as it is (see bootstrap.resolve_artifact).
        model_dir = artifact
        if "model_name" not in given:
            import json

            name = json.loads((artifact / "manifest.json").read_text()).get("model_name")
            if name:
                values["model_name"] = name
                given.add("model_name")
    if model_dir is not None:
        more["model_dir"] = model_dir
    try:
        generation_config = GenerationConfig.from_sources(generation)
    except ValueError as exc:  # pydantic's ValidationError included
        raise typer.BadParameter(str(exc).replace("GenerationConfig", "generation settings"),
                                 param_hint="--generation / SURGE_GENERATION_<FIELD>")
    if lora_modules:
        from surge.config import parse_lora_modules

        try:
            pairs = {**generation_config.lora_modules, **parse_lora_modules(lora_modules)}
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--lora-modules")
        generation_config = GenerationConfig.model_validate(
            {**generation_config.model_dump(exclude_unset=True), "lora_modules": pairs})
    if generation_config.model_fields_set:
        more["generation"] = generation_config
    config = build_config(values, given, **more)
    from surge.runtime.gc_settle import configure

    configure(config.gc_freeze)  # this process and those it spawns (front ends, engine processes)
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
    if workers != 1:  # a repository too: its engine process runs it (cli/workers_repo.py)
        raise typer.Exit(code=serve_workers(config, workers))
    run_server(config)


def run_server(config: ServerConfig) -> None:
    import uvicorn

    from surge.server.app import create_app
    from surge.cli.bootstrap import build_state

    state = build_state(config)
    app, http = create_app(state), "auto"
    try:  # the front ends' fewer layers and one send a response (server/http/frontend.py)
        from surge.server.http.frontend import CorkedHttpToolsProtocol, FrontDoor

        app, http = FrontDoor(app), CorkedHttpToolsProtocol
    except ImportError:  # no httptools: uvicorn's own choice
        pass
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           access_log=False, loop="auto", http=http, timeout_graceful_shutdown=10))
    # A failed start stops the server this way (server/app.py), so that the process exits 1 below rather than
    # by a re-raised SIGTERM.
    state.extras["stop_server"] = lambda: setattr(server, "should_exit", True)
    try:
        server.run()
    except KeyboardInterrupt:  # as uvicorn.run
        pass
    if not server.started and not state.extras.get("startup_error"):
        raise typer.Exit(code=3)  # uvicorn.run's STARTUP_FAILURE (e.g. the port could not be bound)
    if state.extras.get("startup_error"):
        typer.echo(f"surge: startup failed: {state.extras['startup_error']}", err=True)
        raise typer.Exit(code=1)

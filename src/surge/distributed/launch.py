"""`surge serve --ray`: plan, deploy, serve until told to stop, clean up."""

from __future__ import annotations

import signal
import sys
import threading

from surge.config import ServerConfig
from surge.distributed import ray_serve
from surge.distributed.plan import Resolve, plan_repository, plan_single, ray_config


def serve_on_ray(config: ServerConfig, *, address: str | None, overrides: dict, resolve: Resolve) -> None:
    """Blocks until SIGINT/SIGTERM. A local Ray instance (no address) is stopped on
    exit; on an existing cluster only surge's application is deleted."""
    if config.model_repository is not None:
        targets = plan_repository(config, overrides, resolve)
    else:
        targets = plan_single(config, ray_config(None, overrides), resolve)
    if address is None:
        _check_port_free(config.host, config.port)
    where = address or "a local Ray instance"
    if config.grpc_port:
        print("surge: note: under --ray only HTTP is served (no gRPC port)", file=sys.stderr, flush=True)
    for t in targets:
        scale = (f"{t.ray.autoscaling.min_replicas}-{t.ray.autoscaling.max_replicas} replicas (autoscaling)"
                 if t.ray.autoscaling else f"{t.ray.num_replicas} replica(s)")
        print(f"surge: deploying {t.spec.name} v{t.spec.version} on {where}: {scale}, "
              f"{t.ray.num_cpus:g} CPU / {t.ray.num_gpus:g} GPU each", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            ray_serve.deploy(targets, config, address=address)
        except Exception as exc:  # e.g. a replica that cannot load its model: Ray says which
            from surge.errors import EngineError

            raise EngineError(f"deploying on Ray Serve failed: {exc}") from None
        print(f"surge: ready, serving {', '.join(t.spec.name for t in targets)} on "
              f"http://{config.host}:{config.port} (Ray Serve)", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        print("surge: stopping", file=sys.stderr, flush=True)
        ray_serve.undeploy(shutdown=address is None)


def _check_port_free(host: str, port: int) -> None:
    """Ray Serve's proxy would fail to bind in the background and deploying would
    hang; say so up front instead."""
    import socket

    from surge.errors import ConfigError

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot serve on {host}:{port}: {exc.strerror or exc}") from None

"""Deploying surge on Ray Serve.

Each served model version becomes one Ray Serve deployment whose replicas each
run a whole surge ModelService (engine, batcher, cache: `replica.ModelReplica`).
One ingress deployment serves surge's HTTP API (`ingress.SurgeIngress`) and
calls the model deployments through handles. Replicas share hot-query hits
through the Redis cache tier when `CacheConfig.redis_url` is set.

    from surge.distributed.ray_serve import deploy, plan_single
    targets = plan_single(server_config, RayDeploymentConfig(num_replicas=2), resolve=...)
    deploy(targets, server_config)            # starts a local Ray unless address= is given
"""

from __future__ import annotations

import dataclasses
import logging

import ray
from ray import serve

from surge.config import ServerConfig
from surge.distributed.config import RayDeploymentConfig
from surge.distributed.ingress import SurgeIngress
from surge.distributed.metrics_hub import Pusher
from surge.distributed.plan import DeploymentTarget, plan_repository, plan_single
from surge.distributed.generate_replica import GenerateReplica
from surge.distributed.replica import ModelReplica

__all__ = ["DeploymentTarget", "RayDeploymentConfig", "build_application", "connect", "deploy", "plan_repository",
           "plan_single", "replica_states", "undeploy"]

log = logging.getLogger("surge.distributed")

APP_NAME = "surge"
INGRESS_NAME = "surge-ingress"


class _ServeModelReplica(ModelReplica):
    def __init__(self, spec):
        super().__init__(spec)
        self._metrics = Pusher(self.identity)  # this replica's registry to the ingress's /metrics

    async def __del__(self):  # Ray Serve awaits this when it stops a replica gracefully
        self._metrics.stop()
        try:
            await self.close()
        except Exception:  # the process is going away anyway
            pass


class _ServeGenerateReplica(GenerateReplica):
    """A decoder model's replica (task generate): same metrics push and graceful stop."""

    def __init__(self, spec):
        super().__init__(spec)
        self._metrics = Pusher(self.identity)

    __del__ = _ServeModelReplica.__del__


def build_application(targets: list[DeploymentTarget], config: ServerConfig, *, ingress_replicas: int = 1,
                      ingress_cpus: float = 0.0):
    """The Ray Serve application: one deployment per model version plus the ingress
    (`ingress_replicas` copies of surge's HTTP app; Ray's proxy spreads requests over them)."""
    if not targets:
        raise ValueError("nothing to deploy: no model targets")
    model_deployment = serve.deployment(_ServeModelReplica)
    generate_deployment = serve.deployment(_ServeGenerateReplica)
    models = []
    retries = {}
    for target in targets:
        spec = target.spec
        if spec.engine.threads == 0:
            # One ORT thread per reserved CPU: replicas that share a machine do not oversubscribe it.
            spec = dataclasses.replace(spec, engine=spec.engine.model_copy(update={"threads": target.ray.engine_threads()}))
        deployment = generate_deployment if spec.task == "generate" else model_deployment
        bound = deployment.options(name=target.deployment_name, **target.ray.deployment_options()).bind(spec)
        models.append((spec.name, spec.version, bound, spec.task))
        retries[f"{spec.name}:{spec.version}"] = target.ray.request_retries
    ingress = serve.deployment(serve.ingress()(SurgeIngress)).options(
        name=INGRESS_NAME, num_replicas=ingress_replicas, ray_actor_options={"num_cpus": ingress_cpus},
        # The ingress only decodes, routes and encodes; it must never be the queue.
        max_ongoing_requests=4096,
    )
    return ingress.bind(config, models, retries)


def connect(address: str | None = None, *, num_cpus: float | None = None, http_host: str = "127.0.0.1",
            http_port: int = 8000, **init_kwargs) -> None:
    """Join the Ray cluster at `address` (or start a local one) and start Serve's HTTP proxy."""
    if not ray.is_initialized():
        kwargs = {"include_dashboard": False, "log_to_driver": False, **init_kwargs}
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(num_cpus=num_cpus, **kwargs)
    serve.start(http_options={"host": http_host, "port": http_port})


def deploy(targets: list[DeploymentTarget], config: ServerConfig, *, address: str | None = None,
           app_name: str = APP_NAME, route_prefix: str = "/", num_cpus: float | None = None,
           ingress_replicas: int = 1, **init_kwargs):
    """Deploy and wait until every replica is warmed up; returns the ingress handle.

    HTTP is served on config.host:config.port by Ray Serve's proxy. `init_kwargs`
    go to `ray.init` (e.g. namespace, runtime_env).
    """
    connect(address, num_cpus=num_cpus, http_host=config.host, http_port=config.port, **init_kwargs)
    app = build_application(targets, config, ingress_replicas=ingress_replicas)
    return serve.run(app, name=app_name, route_prefix=route_prefix)


def undeploy(app_name: str = APP_NAME, *, shutdown: bool = False) -> None:
    """Delete the application; `shutdown` also stops Serve and (if ours) Ray."""
    if not ray.is_initialized():
        return
    try:
        serve.delete(app_name)
    finally:
        if shutdown:
            serve.shutdown()
            ray.shutdown()


def replica_states(app_name: str = APP_NAME) -> dict[str, dict[str, int]]:
    """Replica counts by state for each model deployment, e.g. {"model-x-v1": {"RUNNING": 2}}."""
    app = serve.status().applications.get(app_name)
    if app is None:
        return {}
    return {name: {str(k): v for k, v in d.replica_states.items()} for name, d in app.deployments.items()
            if name != INGRESS_NAME}

"""How a model is deployed on Ray Serve: replicas, autoscaling, resources.

Pure pydantic, no Ray import: a model.yaml embeds `RayDeploymentConfig` as its
`ray:` section, and `surge serve --ray-*` flags override it field by field.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RayAutoscaling(_Strict):
    """Ray Serve autoscaling: replicas follow the ongoing requests per replica."""

    min_replicas: int = Field(1, ge=0, description="Fewest replicas (0 scales to zero when idle).")
    max_replicas: int = Field(4, ge=1, description="Most replicas.")
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="Ongoing requests per replica that autoscaling aims for."
    )
    upscale_delay_s: float = Field(3.0, ge=0, description="Load must stay high this long before adding replicas.")
    downscale_delay_s: float = Field(60.0, ge=0, description="Load must stay low this long before removing replicas.")

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class RayDeploymentConfig(_Strict):
    """One model's Ray Serve deployment (each replica runs a whole surge ModelService:
    engine, batcher and cache)."""

    num_replicas: int = Field(1, ge=1, description="Fixed replica count; ignored when `autoscaling` is set.")
    autoscaling: RayAutoscaling | None = Field(None, description="Scale between min and max replicas on load.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per replica (fractions allowed, e.g. 0.5).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved per replica (fractions share one GPU).")
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests one replica takes at a time; more queue at the caller. Keep it above the "
        "batch size so the replica's batcher can fill batches."
    )
    health_check_period_s: float = Field(10.0, gt=0, description="How often Ray runs the replica's engine check.")
    health_check_timeout_s: float = Field(30.0, gt=0, description="A check slower than this fails the replica.")
    request_retries: int = Field(
        1, ge=0, le=3, description="Times a request lost with its replica is retried on another one."
    )

    def engine_threads(self) -> int:
        """ORT intra-op threads that match the CPUs Ray reserved (at least 1)."""
        return max(1, int(self.num_cpus + 0.999))

    def deployment_options(self) -> dict:
        """Keyword arguments of Ray Serve's `Deployment.options`."""
        opts: dict = {
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
        }
        if self.autoscaling is not None:
            a = self.autoscaling
            opts["autoscaling_config"] = {
                "min_replicas": a.min_replicas,
                "initial_replicas": max(a.min_replicas, 1),
                "max_replicas": a.max_replicas,
                "target_ongoing_requests": a.target_ongoing_requests,
                "upscale_delay_s": a.upscale_delay_s,
                "downscale_delay_s": a.downscale_delay_s,
            }
        else:
            opts["num_replicas"] = self.num_replicas
        return opts

    def merged(self, overrides: dict | None) -> "RayDeploymentConfig":
        """This config with `overrides` (e.g. flags given on the command line) applied
        field by field; `autoscaling` merges into the existing section."""
        if not overrides:
            return self
        data = self.model_dump()
        for key, value in overrides.items():
            if value is None:
                continue
            if key == "autoscaling" and isinstance(value, dict):
                data["autoscaling"] = {**(data.get("autoscaling") or {}), **{k: v for k, v in value.items() if v is not None}}
            else:
                data[key] = value
        if "num_replicas" in overrides and overrides["num_replicas"] is not None and not overrides.get("autoscaling"):
            data["autoscaling"] = None  # an explicit replica count turns autoscaling off
        return RayDeploymentConfig.model_validate(data)


def flag_overrides(*, replicas: int | None = None, min_replicas: int | None = None, max_replicas: int | None = None,
                   target_ongoing: float | None = None, num_cpus: float | None = None, num_gpus: float | None = None,
                   max_ongoing: int | None = None) -> dict:
    """The `--ray-*` flags that were given, as overrides for `RayDeploymentConfig.merged`."""
    from surge.errors import ConfigError

    scaling = {"min_replicas": min_replicas, "max_replicas": max_replicas, "target_ongoing_requests": target_ongoing}
    if replicas is not None and any(v is not None for v in scaling.values()):
        raise ConfigError("--ray-replicas fixes the replica count; it cannot be combined with the autoscaling "
                          "flags (--ray-min-replicas, --ray-max-replicas, --ray-target-ongoing)")
    out: dict = {"num_replicas": replicas, "num_cpus": num_cpus, "num_gpus": num_gpus,
                 "max_ongoing_requests": max_ongoing}
    if any(v is not None for v in scaling.values()):
        out["autoscaling"] = scaling
    return {k: v for k, v in out.items() if v is not None}

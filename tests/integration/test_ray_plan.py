"""Ray deployment config (model.yaml `ray:` section + flags), deployment planning
and the replica's engine check, without starting Ray."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from surge.config import CacheConfig, EngineConfig, ServerConfig
from surge.distributed.config import RayDeploymentConfig, flag_overrides
from surge.distributed.plan import plan_repository, plan_single, ray_config
from surge.errors import ConfigError, EngineError


def test_fixed_and_autoscaled_deployment_options():
    fixed = RayDeploymentConfig(num_replicas=3, num_cpus=0.5, num_gpus=0.25).deployment_options()
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.25}
    auto = RayDeploymentConfig.model_validate(
        {"autoscaling": {"min_replicas": 0, "max_replicas": 6, "target_ongoing_requests": 4}}).deployment_options()
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["min_replicas"] == 0 and auto["autoscaling_config"]["max_replicas"] == 6
    assert auto["autoscaling_config"]["target_ongoing_requests"] == 4
    assert RayDeploymentConfig(num_cpus=0.5).engine_threads() == 1
    assert RayDeploymentConfig(num_cpus=2).engine_threads() == 2


def test_flags_override_the_model_yaml_section_field_by_field():
    section = {"num_replicas": 3, "num_cpus": 0.25, "max_ongoing_requests": 8}
    merged = ray_config(section, flag_overrides(num_cpus=0.5))
    assert (merged.num_replicas, merged.num_cpus, merged.max_ongoing_requests) == (3, 0.5, 8)
    scaled = ray_config(section, flag_overrides(max_replicas=5))
    assert scaled.autoscaling is not None and scaled.autoscaling.max_replicas == 5
    back = ray_config({"autoscaling": {"max_replicas": 4}}, flag_overrides(replicas=2))
    assert back.autoscaling is None and back.num_replicas == 2
    with pytest.raises(ConfigError, match="cannot be combined"):
        flag_overrides(replicas=2, min_replicas=1)
    with pytest.raises(ConfigError, match="min_replicas .* exceeds max_replicas"):
        ray_config(None, flag_overrides(min_replicas=5, max_replicas=2))
    with pytest.raises(ConfigError, match="ray.num_cpus"):
        ray_config({"num_cpus": -1}, None, where="model.yaml")
    with pytest.raises(ConfigError, match="ray.replicas"):
        ray_config({"replicas": 2}, None, where="model.yaml")  # a typo is an error, not ignored


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_repository_models_get_their_ray_section_and_the_servers_redis_url(tmp_path, bundled_artifact):
    root = tmp_path / "models"
    _write(root / "minilm" / "1" / "model.yaml", "source: bundled\nray:\n  num_replicas: 3\n")
    _write(root / "minilm" / "2" / "model.yaml",
           "source: bundled\nray:\n  num_cpus: 0.25\n  autoscaling: {min_replicas: 1, max_replicas: 3}\n")
    _write(root / "other" / "1" / "model.yaml", "source: bundled\nengine: {threads: 1}\n")
    config = ServerConfig(model_repository=root, cache=CacheConfig(redis_url="redis://127.0.0.1:6379/0"))
    resolved = []

    def resolve(spec, engine, cache_dir):
        resolved.append(spec.name)
        return bundled_artifact

    targets = plan_repository(config, flag_overrides(num_gpus=0.5), resolve)
    by_name = {(t.spec.name, t.spec.version): t for t in targets}
    assert set(by_name) == {("minilm", "2"), ("other", "1")}  # newest version of each model
    minilm = by_name[("minilm", "2")]
    assert minilm.ray.num_cpus == 0.25 and minilm.ray.num_gpus == 0.5
    assert minilm.ray.autoscaling.max_replicas == 3
    assert by_name[("other", "1")].ray == RayDeploymentConfig(num_gpus=0.5)
    assert by_name[("other", "1")].spec.engine.threads == 1
    assert all(t.spec.cache.redis_url == "redis://127.0.0.1:6379/0" for t in targets)
    assert all(t.spec.artifact == bundled_artifact for t in targets) and sorted(resolved) == ["minilm", "other"]
    assert minilm.deployment_name == "model-minilm-v2"

    _write(root / "other" / "1" / "model.yaml", "source: bundled\nray:\n  num_cpus: lots\n")
    with pytest.raises(ConfigError, match=r"other/1/model.yaml.*ray.num_cpus"):
        plan_repository(config, None, resolve)


@pytest.fixture(scope="module")
def replica(bundled_artifact):
    from surge.distributed.replica import ModelReplica

    config = ServerConfig(engine=EngineConfig(threads=1, warmup_shapes=[(1, 8)]))
    (target,) = plan_single(config, RayDeploymentConfig(), resolve=lambda *a: bundled_artifact)
    rep = ModelReplica(target.spec)
    yield rep
    asyncio.run(rep.close())


def test_replica_answers_like_the_reference_and_names_itself(replica, reference_embed, sentences):
    result, identity = asyncio.run(replica.embed(texts=sentences[:3]))
    assert identity == f"local:{os.getpid()}"
    ref = reference_embed(sentences[:3])
    assert np.abs(result.vectors - ref).max() < 1e-4
    asyncio.run(replica.check_health())  # a working engine passes


def test_health_check_fails_when_the_engine_breaks(replica):
    # The engine loses its session (as after a failed reload or a freed arena):
    # the check must fail so that Ray replaces the replica.
    engine = replica.service.worker.engines.engines[0]
    session, engine.session = engine.session, None
    try:
        with pytest.raises(EngineError, match="engine check failed"):
            asyncio.run(replica.check_health())
    finally:
        engine.session = session
    asyncio.run(replica.check_health())


def test_cli_rejects_conflicting_ray_flags_with_a_clear_message():
    from typer.testing import CliRunner

    from surge.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--ray", "--ray-replicas", "2", "--ray-max-replicas", "4"])
    assert result.exit_code == 2
    assert "cannot be combined with the autoscaling flags" in result.output
    assert "Traceback" not in result.output


def test_a_decoder_model_is_planned_unexported_with_its_generation_settings(tmp_path):
    pytest.importorskip("torch")
    from surge.config import GenerationConfig
    from tests.decoder_models import build_model

    model = build_model("gpt2", tmp_path / "tiny-gpt2", seed=1)
    root = tmp_path / "models"
    _write(root / "chat" / "1" / "model.yaml",
           f"source: {model}\ngeneration: {{default_max_tokens: 5}}\nray: {{num_replicas: 2}}\n")
    config = ServerConfig(model_repository=root, generation=GenerationConfig(max_waiting=3, default_max_tokens=9))

    def resolve(*_):
        raise AssertionError("a decoder model is not exported")

    (target,) = plan_repository(config, None, resolve)
    assert target.spec.task == "generate" and target.spec.artifact is None and target.ray.num_replicas == 2
    assert (target.spec.generation.default_max_tokens, target.spec.generation.max_waiting) == (5, 3)
    (single,) = plan_single(ServerConfig(model_dir=model, generation=GenerationConfig(max_waiting=3)),
                            RayDeploymentConfig(), resolve)
    assert single.spec.task == "generate" and single.spec.generation.max_waiting == 3
    _write(root / "chat" / "1" / "model.yaml", f"source: {model}\ngeneration: {{max_waiting: 0}}\n")
    with pytest.raises(ConfigError, match="generation.max_waiting"):
        plan_repository(config, None, resolve)

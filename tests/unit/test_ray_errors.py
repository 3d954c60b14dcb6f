"""What a client is told when Ray fails a call to a model's replicas (distributed/ingress.ray_error), with
Ray's own exception classes: a deployment with no replica to take the call (being deployed, scaled from
zero, unhealthy) is a 503 with Retry-After, as a lost replica is; it reached the client as a bare 500."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from ray.serve._private.common import DeploymentID  # noqa: E402
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError  # noqa: E402

from surge.distributed.ingress import ray_error  # noqa: E402
from surge.errors import NotReady, Overloaded  # noqa: E402


def test_a_deployment_without_a_replica_is_a_503_with_retry_after():
    err = ray_error("m", DeploymentUnavailableError(DeploymentID(name="m", app_name="surge")))
    assert isinstance(err, NotReady) and err.http_status == 503 and err.retry_after == 1
    assert "m" in err.message


def test_a_lost_replica_and_full_queues_keep_their_answers():
    lost = ray_error("m", ReplicaUnavailableError("replica gone"))
    assert isinstance(lost, NotReady) and lost.http_status == 503
    full = ray_error("m", BackPressureError(num_queued_requests=10, max_queued_requests=10))
    assert isinstance(full, Overloaded) and full.http_status == 429
    other = ValueError("x")
    assert ray_error("m", other) is other

"""The heap freeze of a serving process (runtime/gc_settle.py), with the real start-up and the real
repository: a started server's models are frozen (full collections skip them), and a model frozen with the
start-up and then unloaded or replaced is freed, not kept for good in the permanent generation."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest
from starlette.testclient import TestClient

from surge.cli.bootstrap import build_state, load_repository_version
from surge.config import ServerConfig
from surge.runtime import gc_settle
from surge.runtime.registry import ModelRegistry
from surge.runtime.repository import ModelRepository
from surge.server.app import create_app
from tests.e2e.repo_helpers import add_version


def _is_frozen(obj) -> bool:
    assert gc.is_tracked(obj)
    return not any(o is obj for o in gc.get_objects())  # get_objects leaves the permanent generation out


@pytest.mark.parametrize("freeze", [True, False])
def test_a_started_server_has_frozen_its_models(thawed, freeze):
    state = build_state(ServerConfig(grpc_port=None, gc_freeze=freeze, engine={"threads": 1}))
    with TestClient(create_app(state)) as client:  # the app's start-up: models loaded, warmed up, settled
        end = time.monotonic() + 180
        while client.get("/ready").status_code != 200:  # the start-up runs as a task of the app's lifespan
            assert time.monotonic() < end and "startup_error" not in state.extras, state.extras.get("startup_error")
            time.sleep(0.05)
        service = state.registry.get(state.registry.names()[0])
        if freeze:
            assert gc.get_freeze_count() > 50_000  # the web stack, ONNX Runtime's bindings, the model
            assert _is_frozen(service)
        else:
            assert gc.get_freeze_count() == 0 and not _is_frozen(service)


def test_a_frozen_model_unloaded_or_replaced_is_freed(thawed, tmp_path):
    add_version(tmp_path, "enc", 1)
    config = ServerConfig(model_repository=tmp_path, grpc_port=None)
    built = []

    def loader(entry):  # the server's own loader; each build watched by a weak reference
        service = load_repository_version(config, entry, single=False)
        built.append(weakref.ref(service))
        return service

    async def run():
        repo = ModelRepository(tmp_path, ModelRegistry(), loader)
        await repo.start()
        assert gc_settle.settle(True)  # as the server once started (server/app.py)
        assert _is_frozen(built[0]())
        await repo.reload("enc")  # version 1 rebuilt: the start-up's build retired
        gc.collect()
        assert built[0]() is None, "the start-up's build, frozen, outlived its replacement"
        assert _is_frozen(built[1]()), "the replacement is not frozen"
        await repo.unload("enc")
        await repo.load("enc")
        gc.collect()
        assert built[1]() is None, "an unloaded frozen build was kept"
        assert _is_frozen(built[2]())
        await repo.close()

    asyncio.run(run())

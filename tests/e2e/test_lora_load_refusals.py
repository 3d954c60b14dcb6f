"""vLLM's POST /v1/load_lora_adapter against a real `surge serve BASE --generation allow_runtime_lora=true`:
what a request's directory holds is checked before it is read. A FIFO (or any file that is not a regular
file) is a 400 naming lora_path, never a load (and a lock on every other load) that waits for ever; a rank
above max_lora_rank is a 400 from adapter_config.json, before the weights are read; messages name the path
as the client gave it, never the server's working directory; the server then still loads a good adapter."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from tests.decoder_models import build_lora, build_model
from tests.server_process import ROOT, ServerProcess

# a FIFO's load used to block: a short timeout makes that a failure, not a hung test
TIMEOUT = 60


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lorarefuse")
    base = build_model("qwen2", root / "base-qwen", seed=3)
    return {"root": root, "base": base, "good": build_lora(base, root / "good", seed=1, r=4)}


@pytest.fixture(scope="module")
def server(dirs):
    with ServerProcess(str(dirs["base"]), "--threads", "1", "--generation", "allow_runtime_lora=true") as srv:
        yield srv


def _load(server, name: str, path: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      timeout=TIMEOUT)


def _copy(dirs, name: str):
    out = dirs["root"] / name
    shutil.copytree(dirs["good"], out)
    return out


def _refused(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "lora_path" and err["type"] == "invalid_request_error", err
    return err["message"]


@pytest.mark.parametrize("which", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_fifo_is_refused_naming_the_relative_path_as_given(server, dirs, which):
    adapter = _copy(dirs, f"fifo-{which.split('.')[0]}")
    (adapter / which).unlink()
    os.mkfifo(adapter / which)
    given = os.path.relpath(adapter, ROOT)  # relative to the server's working directory
    assert not os.path.isabs(given)
    message = _refused(_load(server, "fifo", given))
    assert "not a regular file" in message and os.path.join(given, which) in message, message
    assert str(ROOT) not in message and str(adapter) not in message.replace(given, ""), message
    # nothing was left holding the adapters' lock
    ok = _load(server, "good", str(dirs["good"]))
    assert ok.status_code == 200, ok.text
    gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "good"}, timeout=TIMEOUT)
    assert gone.status_code == 200, gone.text


def test_a_missing_relative_directory_does_not_reveal_the_working_directory(server):
    message = _refused(_load(server, "missing", "no-such-adapter-dir"))
    assert "no-such-adapter-dir/adapter_config.json" in message, message
    assert str(ROOT) not in message, message


def test_a_rank_over_the_limit_is_refused_before_the_weights_are_read(server, dirs):
    adapter = _copy(dirs, "too-wide")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 64, "lora_alpha": 128}))
    # the weights are not even a safetensors file: read, they would be another error (or none)
    (adapter / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    message = _refused(_load(server, "too-wide", str(adapter)))
    assert "rank 64" in message and "max_lora_rank 16" in message, message


def test_weights_wider_than_their_config_say_are_refused(server, dirs):
    """The safetensors header's shapes are checked too (a config that understates the rank)."""
    adapter = build_lora(dirs["base"], dirs["root"] / "understated", seed=2, r=32)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    message = _refused(_load(server, "understated", str(adapter)))
    assert "rank 32" in message and "max_lora_rank 16" in message, message


def test_a_corrupt_weights_file_is_a_400(server, dirs):
    adapter = _copy(dirs, "corrupt")
    (adapter / "adapter_model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{not json")
    message = _refused(_load(server, "corrupt", str(adapter)))
    assert "adapter_model.safetensors" in message, message

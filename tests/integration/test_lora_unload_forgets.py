"""An unloaded LoRA adapter leaves nothing behind: its /metrics series and its KServe statistics go with it.

With `allow_runtime_lora`, clients load and unload adapters under names of their choosing (vLLM's routes). Each
name a request used kept a `surge_generate_lora_requests{adapter=...}` series and a KServe statistics entry for
good, so load, ask, unload in a loop under new names grew /metrics (label cardinality) and the statistics without
bound (8 cycles: 8 series, 8 entries). The real app under uvicorn in this process (the statistics are read off its
state), the tiny Qwen2 model and a PEFT adapter; requests over real HTTP."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("torch")
pytest.importorskip("peft")

from tests.decoder_models import build_lora, build_model
from tests.integration.test_direct_http import InProcessServer

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("loraforget")
    base = build_model("qwen2", root / "base-qwen", seed=3)
    return base, build_lora(base, root / "adapter", seed=1, r=4)


PREFIX = "client-chosen-"


def _adapter_series(url: str) -> set[str]:
    """The adapters named by this test that have a series (the in-process server's registry is the process's:
    adapters of other tests run before in the same process may have theirs)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.labels["adapter"] for fam in text_string_to_metric_families(text)
            if fam.name == "surge_generate_lora_requests" for s in fam.samples
            if s.labels.get("adapter", "").startswith(PREFIX)}


def test_an_unloaded_adapter_keeps_no_series_and_no_statistics(dirs):
    base, adapter = dirs
    gen = {"max_loras": 1, "max_cpu_loras": 1, "allow_runtime_lora": True}
    with InProcessServer(model_dir=base, generation=gen) as srv:
        url = f"http://127.0.0.1:{srv.port}"
        with httpx.Client(base_url=url, timeout=120) as http:
            for i in range(8):
                name = f"{PREFIX}{i}"
                r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)})
                assert r.status_code == 200, r.text
                r = http.post("/v1/completions", json={"model": name, "prompt": "Hello", "max_tokens": 2,
                                                        "temperature": 0})
                assert r.status_code == 200, r.text
                assert _adapter_series(url) == {name}  # counted while it is loaded
                r = http.post("/v1/unload_lora_adapter", json={"lora_name": name})
                assert r.status_code == 200, r.text
            # a stream still running when its adapter is unloaded finishes, and is not recorded under the name
            name = "client-chosen-streaming"
            r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)})
            assert r.status_code == 200, r.text
            ask = {"model": name, "prompt": "Hello", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                   "stream": True}
            with http.stream("POST", "/v1/completions", json=ask) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # it runs
                r = http.post("/v1/unload_lora_adapter", json={"lora_name": name})
                assert r.status_code == 200, r.text
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert _adapter_series(url) == set()
            kept = {name for name, _ in srv.state.stats._models}
            assert not any(n.startswith("client-chosen-") for n in kept), kept
            # the base model's own statistics and series stay
            r = http.post("/v1/completions", json={"model": "base-qwen", "prompt": "Hello", "max_tokens": 2})
            assert r.status_code == 200, r.text

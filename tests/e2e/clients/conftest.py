"""Two real `surge serve` processes shared by every test of the other ecosystems' clients.

`main`: an API key, aliases (what OpenAI clients, LangChain and LlamaIndex ask for by
default), gRPC, a separate metrics port, small batches (so a 2,048-input request is
seen split). `lenient`: the opt-in flags (--auto-truncate, --allow-token-ids,
--metrics-public) and gRPC; its model is unloaded and loaded again by the health test.
"""

from __future__ import annotations

import pytest

from tests.server_process import ServerProcess, free_port

API_KEY = "clients-key-42"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ALIASES = ["text-embedding-3-small", "text-embedding-ada-002", "surge-alias"]
MODEL = "all-MiniLM-L6-v2"
MAX_BATCH = 32


@pytest.fixture(scope="session")
def main_server():
    metrics_port = free_port()
    with ServerProcess("--api-key", API_KEY, "--served-model-name", ",".join(ALIASES[:2]),
                       "--served-model-name", ALIASES[2], "--metrics-port", str(metrics_port),
                       "--threads", "2", "--max-batch-size", str(MAX_BATCH), grpc=True) as srv:
        srv.metrics_port = metrics_port
        yield srv


@pytest.fixture(scope="session")
def lenient_server():
    with ServerProcess("--api-key", API_KEY, "--metrics-public", "--auto-truncate", "--allow-token-ids",
                       "--threads", "1", grpc=True) as srv:
        yield srv

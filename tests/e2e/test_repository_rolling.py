"""Zero-downtime updates against a real server: 32 clients keep sending while
version 1 is replaced by version 2; then 50 unload/load cycles without RSS growth."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import numpy as np
import psutil
import pytest

from tests.conftest import cosine_rows
from tests.e2e.repo_helpers import add_version, entries, serving
from tests.server_process import ServerProcess

CLIENTS = 32
# Version 2 truncates inputs to 8 tokens, so its vectors for these (longer)
# sentences differ from version 1's: a response's rows show which version made them.
V2 = "engine: {threads: 1, warmup_shapes: [[1, 8]], max_seq_len: 8}\n"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("rolling")
    add_version(root, "enc", 1)
    return root


@pytest.fixture(scope="module")
def server(repo):
    with ServerProcess("--model-repository", str(repo)) as srv:
        yield srv


def vectors(client, texts) -> tuple[str, np.ndarray]:
    r = client.post("/embed", json={"inputs": texts, "model": "enc"})
    assert r.status_code == 200, r.text
    return r.json()["version"], np.array(r.json()["embeddings"], dtype=np.float32)


def test_rolling_update_under_load(server, repo, sentences, reference_embed):
    texts = [s for s in sentences if len(s.split()) >= 14][:12]
    assert len(texts) == 12
    with httpx.Client(base_url=server.url, timeout=120) as c:
        version, v1 = vectors(c, texts)
        assert version == "1"
        assert cosine_rows(v1, reference_embed(texts)).min() >= 0.99999

    log: list[dict] = []
    switched: dict[str, float] = {}
    stop = asyncio.Event()

    async def client_loop(seed: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            idx = rng.sample(range(len(texts)), 2)
            sent = time.monotonic()
            try:
                r = await http.post("/embed", json={"inputs": [texts[i] for i in idx], "model": "enc"})
                entry = {"sent": sent, "status": r.status_code, "idx": idx, "text": r.text}
                if r.status_code == 200:
                    body = r.json()
                    entry.update(version=body["version"], header=r.headers.get("x-surge-model-version"),
                                 rows=np.array(body["embeddings"], dtype=np.float32))
            except httpx.HTTPError as exc:
                entry = {"sent": sent, "status": -1, "text": repr(exc)}
            log.append(entry)
            # A short think time keeps the server busy without starving the
            # loader of version 2 of all CPU on a 2-core machine.
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            tasks = [asyncio.create_task(client_loop(i, http)) for i in range(CLIENTS)]
            await asyncio.sleep(1.0)
            add_version(repo, "enc", 2, V2)
            r = await http.post("/models/enc/load")  # policy latest 1: load 2, switch, drain 1
            switched["at"] = time.monotonic()
            switched["status"] = r.status_code
            await asyncio.sleep(1.5)
            stop.set()
            await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert switched["status"] == 200
    failed = [e for e in log if e["status"] != 200]
    assert not failed, f"{len(failed)} of {len(log)} requests failed, e.g. {failed[0]['status']}: {failed[0]['text']}"

    with httpx.Client(base_url=server.url, timeout=120) as c:
        version, v2 = vectors(c, texts)
        assert version == "2" and serving(c, "enc") == ["2"]
        assert entries(c, "enc")["1"]["state"] == "UNAVAILABLE"
    expected = {"1": v1, "2": v2}
    # The two versions really answer differently for these inputs.
    assert cosine_rows(v1, v2).max() < 0.999

    seen = {"1": 0, "2": 0}
    for e in log:
        assert e["header"] == e["version"]
        want, other = expected[e["version"]], expected["2" if e["version"] == "1" else "1"]
        # Every row comes from the version the response names: exactly one version per response.
        assert cosine_rows(e["rows"], want[e["idx"]]).min() >= 0.99999
        assert cosine_rows(e["rows"], other[e["idx"]]).max() < 0.999
        seen[e["version"]] += 1
        if e["sent"] > switched["at"]:
            assert e["version"] == "2", "version 1 answered a request sent after the switch"
    assert seen["1"] > 0 and seen["2"] > 0, seen
    print(f"\nrolling update: {len(log)} requests from {CLIENTS} clients, 0 failed, by version: {seen}")


def test_unload_and_load_50_times_does_not_grow_rss(server):
    """Bound: the lowest RSS reading of the last 25 cycles may exceed the median of cycles 5-10 by at most
    64 MiB, less than one copy of the model's weights (87 MiB). An engine leaked in any of the first 25
    cycles, or one leaked every cycle, stays in every later reading and fails the test. What it lets
    through is memory held until Python's full collection: measured as a sawtooth, +1.3 MiB a cycle and
    released every ~20 cycles, which put the last readings 45-72 MiB over the early ones (the last-5
    readings the test compared before failed CI twice at 71-72 MiB with no engine leaked)."""
    proc = psutil.Process(server.proc.pid)
    rss: list[int] = []
    with httpx.Client(base_url=server.url, timeout=120) as c:
        for cycle in range(50):
            assert c.post("/models/enc/unload").status_code == 200
            r = c.post("/models/enc/load")
            assert r.status_code == 200, r.text
            assert c.post("/embed", json={"inputs": ["cycle %d" % cycle], "model": "enc"}).status_code == 200
            rss.append(proc.memory_info().rss)
    mib = np.array(rss) / 2**20
    early, late = float(np.median(mib[5:10])), float(mib[25:].min())
    print("\nRSS per cycle (MiB):", " ".join(f"{m:.0f}" for m in mib))
    print(f"RSS over 50 unload/load cycles: first {mib[0]:.0f} MiB, cycles 5-10 median {early:.0f} MiB, "
          f"lowest of the last 25 {late:.0f} MiB, peak {mib.max():.0f} MiB")
    assert late - early < 64, f"RSS grew from {early:.0f} MiB to at least {late:.0f} MiB over the last 25 reloads"

"""`surge serve --model-repository DIR --workers 2`: real processes (supervisor, two front ends, the
engine process running the repository).

Every front end serves every embedding model of the repository with the right model's vectors under
concurrency (two models, interleaved: no mixing); a non-embedding model is refused with a reason in the
index; repository calls made through one front end change what every front end serves; a new version
added while clients send takes over with no failed request (zero downtime across processes).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import numpy as np
import psutil
import pytest

from tests.conftest import cosine_rows
from tests.e2e.repo_helpers import FAST, add_version
from tests.server_process import ServerProcess, fresh_client

pytestmark = pytest.mark.timeout(300)

SHORT = "engine: {threads: 1, warmup_shapes: [[1, 8]], max_seq_len: 8}\n"  # vectors of the first 8 tokens


def _repo(root):
    add_version(root, "enc", 1)
    add_version(root, "short", 1, SHORT)
    add_version(root, "cls", 1, "task: classify\n" + FAST)
    return root


@pytest.fixture(scope="module", params=[1, 2], ids=["one-engine-process", "two-engine-processes"])
def server(tmp_path_factory, request):
    """Two front ends; one engine process, or two (front end i talks to engine process i, each runs
    the repository, and repository calls from either front end must reach both)."""
    repo = _repo(tmp_path_factory.mktemp("workers_repo"))
    with ServerProcess("--model-repository", str(repo), "--workers", "2", "--engine-processes", str(request.param),
                       "--repository-poll-s", "0.5", "--cache-bytes", "0") as srv:
        srv.engine_processes, srv.repo = request.param, repo
        yield srv


def _children(srv, role: str) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(srv.proc.pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            continue
        if "surge.cli.workers" in cmd and cmd[cmd.index("surge.cli.workers") + 1] == role:
            out.append(p)
    return out


async def _embed_many(url: str, jobs: list[tuple[str, list[str]]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=16)) as c:
        sem = asyncio.Semaphore(16)

        async def one(model, texts):
            async with sem:
                return await c.post("/embed", json={"inputs": texts, "model": model})

        return await asyncio.gather(*(one(m, t) for m, t in jobs))


def test_every_front_end_serves_each_model_with_its_own_vectors(server, sentences, reference_embed):
    assert len(_children(server, "front")) == 2
    assert len(_children(server, "engine")) == server.engine_processes
    texts = [s for s in sentences if len(s.split()) >= 12][:24]
    ref_enc = reference_embed(texts)
    rng = random.Random()
    jobs = []
    for _ in range(96):
        idx = rng.sample(range(len(texts)), rng.randint(1, 3))
        jobs.append((rng.choice(["enc", "short"]), idx))
    rs = asyncio.run(_embed_many(server.url, [(m, [texts[i] for i in idx]) for m, idx in jobs]))
    short_rows: dict[int, list[np.ndarray]] = {}
    for (model, idx), r in zip(jobs, rs):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == model and body["version"] == "1"
        rows = np.array(body["embeddings"], np.float32)
        if model == "enc":
            assert cosine_rows(rows, ref_enc[idx]).min() >= 0.9999
        else:  # max_seq_len 8: not the full sentence's vector, and the same row every time
            assert cosine_rows(rows, ref_enc[idx]).max() < 0.999
            for i, row in zip(idx, rows):
                short_rows.setdefault(i, []).append(row)
    for rows in short_rows.values():
        np.testing.assert_allclose(np.stack(rows), np.stack([rows[0]] * len(rows)), atol=1e-5)
    # Every served model's engine-build counts reach the front ends' /metrics; none after ready.
    end = time.monotonic() + 10
    while True:
        text = httpx.get(server.url + "/metrics", headers={"connection": "close"}, timeout=30).text
        served = [ln for ln in text.splitlines() if ln.startswith("surge_engine_graph_builds_total{")
                  and 'phase="serving"' in ln]
        if {m for m in ("enc", "short") if any(f'model="{m}"' in ln for ln in served)} == {"enc", "short"}:
            break
        assert time.monotonic() < end, served
        time.sleep(0.5)
    assert all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in served), served


def test_a_non_embedding_model_is_refused_with_the_reason_and_the_rest_serves(server):
    r = httpx.get(server.url + "/models", timeout=30)
    assert r.status_code == 200
    by_name = {m["name"]: m for m in r.json()["models"]}
    assert by_name["enc"]["state"] == by_name["short"]["state"] == "READY"
    cls = by_name["cls"]
    assert cls["state"] == "UNAVAILABLE" and "--workers 1" in cls["reason"] and "classify" in cls["reason"]
    r = httpx.post(server.url + "/v2/repository/index", json={}, timeout=30)  # KServe's index, same source
    assert r.status_code == 200 and {"cls", "enc", "short"} <= {m["name"] for m in r.json()}
    assert httpx.post(server.url + "/embed", json={"inputs": ["x"], "model": "cls"}, timeout=30).status_code == 404


def _all_fronts_answer(srv, model: str, status: int, tries: int = 40) -> bool:
    """`tries` requests on fresh connections (the kernel spreads them over both front ends)."""
    for _ in range(tries):
        with fresh_client(srv.url, timeout=30) as c:
            if c.post("/embed", json={"inputs": ["hello there"], "model": model}).status_code != status:
                return False
    return True


def test_unload_and_load_through_one_front_end_reach_every_front_end(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        # a bad call is answered by the engine process with its own error, status and all
        bad = c.post("/models/enc/load", json={"version": "x1"})
        assert bad.status_code == 400 and "version" in bad.text, bad.text
        missing = c.post("/models/nope/load")
        assert missing.status_code == 404 and "nope" in missing.text, missing.text
        assert c.post("/models/short/unload").status_code == 200
    assert _all_fronts_answer(server, "short", 404)
    with httpx.Client(base_url=server.url, timeout=120) as c:
        assert c.post("/models/short/load").status_code == 200
    assert _all_fronts_answer(server, "short", 200)


def test_a_new_version_takes_over_under_load_with_no_failed_request(server, sentences, reference_embed):
    texts = [s for s in sentences if len(s.split()) >= 14][:8]
    full = reference_embed(texts)
    log: list[tuple[int, str, np.ndarray, list[int]]] = []
    stop = asyncio.Event()

    async def client_loop(seed: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            idx = rng.sample(range(len(texts)), 2)
            r = await http.post("/embed", json={"inputs": [texts[i] for i in idx], "model": "enc"})
            body = r.json()
            log.append((r.status_code, body.get("version", ""), np.array(body.get("embeddings", []), np.float32), idx))

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=16)) as http:
            tasks = [asyncio.create_task(client_loop(s, http)) for s in range(12)]
            await asyncio.sleep(1.0)
            add_version(server.repo, "enc", 2, SHORT)  # the poller (0.5 s) loads it; v1 retires once it serves
            end = time.monotonic() + 150
            while time.monotonic() < end:
                await asyncio.sleep(0.5)
                recent = [v for _, v, _, _ in log[-24:]]
                if len(recent) == 24 and set(recent) == {"2"}:
                    break
            await asyncio.sleep(1.0)
            stop.set()
            await asyncio.gather(*tasks)

    asyncio.run(main())
    assert log and all(status == 200 for status, _, _, _ in log), {s for s, _, _, _ in log}
    versions = [v for _, v, _, _ in log]
    assert versions[0] == "1" and versions[-1] == "2" and set(versions) == {"1", "2"}
    for _, version, rows, idx in log:  # each answer is wholly its version's computation
        cos = cosine_rows(rows, full[idx])
        assert cos.min() >= 0.9999 if version == "1" else cos.max() < 0.999


def test_a_restarted_engine_process_serves_each_model_again_never_another_models(server, sentences,
                                                                                 reference_embed):
    """Killed, the engine process is started again with a new numbering of its builds; the front ends
    follow its new CATALOG and every answer is still its own model's."""
    texts = [s for s in sentences if len(s.split()) >= 12][:6]
    ref = reference_embed(texts)
    engines = _children(server, "engine")
    for p in engines:
        p.kill()
    end = time.monotonic() + 180
    seen_ok = 0
    while time.monotonic() < end and seen_ok < 20:
        with fresh_client(server.url, timeout=60) as c:
            for model in ("enc", "short"):
                t0 = time.monotonic()
                r = c.post("/embed", json={"inputs": texts, "model": model})
                assert time.monotonic() - t0 < 30  # failing fast while it is away, never hanging
                if r.status_code != 200:
                    assert r.status_code in (503, 404), r.text
                    continue
                rows = np.array(r.json()["embeddings"], np.float32)
                cos = cosine_rows(rows, ref)
                model_rows = r.json()["model"]
                assert model_rows == model
                if model == "enc" and r.json()["version"] == "1":
                    assert cos.min() >= 0.9999
                else:  # short (or enc's version 2, max_seq_len 8)
                    assert cos.max() < 0.999
                seen_ok += 1
        time.sleep(0.2)
    assert seen_ok >= 20
    assert {p.pid for p in _children(server, "engine")}.isdisjoint({p.pid for p in engines})

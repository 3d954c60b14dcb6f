"""Single-model mode: a reload (KServe repository load of the loaded model) under load drops nothing."""

from __future__ import annotations

import asyncio

import httpx

from tests.server_process import ServerProcess


def test_reload_under_load_answers_every_request(sentences):
    with ServerProcess("--threads", "1", "--cache-bytes", "0") as srv:
        name = httpx.get(srv.url + "/v1/models").json()["data"][0]["id"]

        async def main():
            stop = asyncio.Event()
            codes: list[int] = []
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                async def client(k):
                    i = k
                    while not stop.is_set():
                        r = await c.post("/embed", json={"inputs": [sentences[i % len(sentences)]]})
                        codes.append(r.status_code)
                        i += 7

                tasks = [asyncio.ensure_future(client(k)) for k in range(8)]
                await asyncio.sleep(0.5)
                for _ in range(3):
                    r = await c.post(f"/v2/repository/models/{name}/load")
                    assert r.status_code == 200, r.text
                await asyncio.sleep(0.3)
                stop.set()
                await asyncio.gather(*tasks)
            return codes

        codes = asyncio.run(main())
        assert len(codes) > 20
        assert set(codes) == {200}, {c: codes.count(c) for c in set(codes)}

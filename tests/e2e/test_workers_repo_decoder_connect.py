"""`surge serve --model-repository DIR --workers 2` with a decoder whose build does not answer while a front
end connects to it: real processes (supervisor, two front ends, the engine process, the decoder build's
process).

The decoder build's process is stopped (SIGSTOP: its socket still accepts, nothing answers the handshake),
one front end is stopped too and the other killed: the supervisor's new front end, the only one taking
connections, builds its services from the CATALOG while the build stalls. It must

- keep answering everything else meanwhile (health, the embedding model): its connect to the build runs
  off its event loop, and an attempt on a stalled build ends (SURGE_HUB_CONNECT_S, 2 s here) instead of
  holding a thread for as long as the build stalls;
- try again in the background: once the build runs again (SIGCONT) the decoder is served by that front
  end, and by every front end, with the same text as before.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from tests.decoder_models import build_model
from tests.e2e.repo_helpers import add_version
from tests.server_process import ServerProcess, children_by_role, fresh_client

pytestmark = pytest.mark.timeout(300)

PROMPT = "The augmented assignment statement"


def _completion(url: str) -> httpx.Response:
    with fresh_client(url, timeout=120) as c:  # a fresh connection: whichever front end accepts it
        return c.post("/v1/completions", json={"model": "chat", "prompt": PROMPT, "max_tokens": 8,
                                               "temperature": 0, "ignore_eos": True})


def _until(what, timeout_s: float = 120.0):
    """Polls `what()` until it is truthy (its value) or `timeout_s` passed (None)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(0.1)
    return None


def test_a_stalled_decoder_build_neither_stalls_a_front_end_nor_stays_missing(tmp_path):
    model_dir = build_model("qwen2", tmp_path / "chat-qwen", seed=4)
    root = tmp_path / "repo"
    (root / "chat" / "1").mkdir(parents=True)
    (root / "chat" / "1" / "model.yaml").write_text(f"source: {model_dir}\nengine:\n  threads: 1\n"
                                                    "generation:\n  cache_entries: 0\n")
    add_version(root, "enc", 1)
    stopped: list[psutil.Process] = []
    with ServerProcess("--model-repository", str(root), "--workers", "2", "--cache-bytes", "0",
                       env={"SURGE_HUB_CONNECT_S": "2"}) as srv:
        try:
            first = _completion(srv.url)
            assert first.status_code == 200, first.text
            reference = first.json()["choices"][0]["text"]
            engine = children_by_role(srv)["engine"][0]
            (build,) = [p for p in engine.children() if "surge.cli.workers_generate" in " ".join(p.cmdline())]
            keep, gone = children_by_role(srv)["front"]
            for p in (build, keep):
                p.send_signal(signal.SIGSTOP)
                stopped.append(p)
            gone.kill()
            # the new front end: the only one accepting; it connects to the stalled build
            new = _until(lambda: [p for p in children_by_role(srv)["front"] if p.pid not in (keep.pid, gone.pid)])
            assert new, srv.output()
            (new,) = new
            # its event loop serves meanwhile: the embedding model answers once the front end has the
            # engine's CATALOG (503 before), and health too (a front end whose loop waits in the connect
            # accepts nothing more: these time out)
            def embedded():
                with fresh_client(srv.url, timeout=60) as c:
                    r = c.post("/v1/embeddings", json={"model": "enc", "input": "an embedding"})
                assert r.status_code in (200, 503), r.text
                return r.status_code == 200 and r

            r = _until(embedded)
            assert r and len(r.json()["data"][0]["embedding"]) == 384, srv.output()
            with fresh_client(srv.url, timeout=60) as c:
                assert c.get("/health").status_code == 200
            # an attempt on the stalled build ended, and the front end said it is ready without the decoder
            assert _until(lambda: f"front end {new.pid} ready, serving enc:1 " in srv.output(tail=1 << 20)), \
                srv.output()
            assert "connecting to its build failed" in srv.output(tail=1 << 20)
            assert _completion(srv.url).status_code == 404  # not served here yet
            build.send_signal(signal.SIGCONT)
            stopped.remove(build)
            # tried again in the background: the decoder comes to the new front end, same text
            back = _until(lambda: (r := _completion(srv.url)).status_code == 200 and r)
            assert back, srv.output()
            assert back.json()["choices"][0]["text"] == reference
            keep.send_signal(signal.SIGCONT)
            stopped.remove(keep)
            for _ in range(12):  # fresh connections over both front ends: every one serves it
                r = _completion(srv.url)
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference, r.text
        finally:
            for p in stopped:  # never leave a stopped process behind (the server's stop would wait on it)
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass

"""A lone request's timeline in every process: a traced copy of src, and the report of its events.

    python benchmarks/trace_lone_request.py make DEST      # DEST/src: this tree with trace events
    SURGE_TRACE_DIR=DIR PYTHONPATH=DEST/src:... surge serve ...  # serve it; one client only
    python benchmarks/trace_lone_request.py report DIR     # median of each step, across processes

The copy records (event, perf_counter_ns) at ~25 points of the path (HTTP in, body, parse, tokenize,
IPC out and in, the batcher, each step of the engine's launch, the wait, the answer), each process
to DIR/ev.PID in blocks of 6,000 events (the last partial block is not written). perf_counter is
CLOCK_MONOTONIC, one clock for every process of the machine, so with one client the events of all
processes sorted by time are one request after another; `report` prints the median of each
consecutive pair. The patches match code by its exact text and stop with an AssertionError when the
code has changed: update them with it. Used for docs/benchmarks/serving_core.md, session 5 (with
`benchmarks/gpu_serving.py --surge "trace=PYTHONPATH=DEST/src:... SURGE_TRACE_DIR=DIR" --clients 1`).
"""

from __future__ import annotations

import collections
import glob
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_TRACE_PY = """import os, time
_EV = []
_DIR = os.environ.get("SURGE_TRACE_DIR", "/tmp/trace")
def ev(name):
    _EV.append((name, time.perf_counter_ns()))
    if len(_EV) >= 6000:
        os.makedirs(_DIR, exist_ok=True)
        with open(f"{_DIR}/ev.{os.getpid()}", "a") as f:
            f.write("\\n".join(f"{a} {b}" for a, b in _EV) + "\\n")
        _EV.clear()
"""


def make(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    subprocess.run(f"git archive HEAD src | tar -x -C {dest}", shell=True, check=True, cwd=ROOT)
    root = dest / "src" / "surge"
    (root / "_trace.py").write_text(_TRACE_PY)
    imp = "from surge._trace import ev as _ev\n"
    def patch(rel, pairs, top="import numpy as np\n"):
        p = root / rel
        s = p.read_text()
        s = s.replace(top, top + imp, 1) if top else s
        for old, new in pairs:
            assert old in s, (rel, old)
            s = s.replace(old, new, 1)
        p.write_text(s)
    patch("runtime/ipc.py", [
     ("        return await self._call(timings, lambda proto, rid: proto.box.submit(", "        _ev('fe_submit'); return await self._call(timings, lambda proto, rid: proto.box.submit("),
     ("        self.transport.write(frame)\n        return True", "        self.transport.write(frame); _ev('written')\n        return True"),
     ("        reqs, self.submits = self.submits, []\n        return [W.encode_submits(reqs)]", "        reqs, self.submits = self.submits, []\n        _ev('fe_flush')\n        return [W.encode_submits(reqs)]"),
     ("            self.transport.write(b\"\".join(out))", "            self.transport.write(b\"\".join(out)); _ev('written')"),
     ("    def data_received(self, data: bytes) -> None:\n        pending = self.client._pending", "    def data_received(self, data: bytes) -> None:\n        _ev('fe_ipc_in')\n        pending = self.client._pending"),
     ("            if kind == W.SUBMITS:\n", "            if kind == W.SUBMITS:\n                _ev('eng_in')\n"),
     ("                for rid, items, deadline, priority, model in W.decode_submits(body):\n", "                for rid, items, deadline, priority, model in W.decode_submits(body):\n                    _ev('eng_decoded')\n"),
     ("        self.futures[rid] = fut\n", "        self.futures[rid] = fut\n        _ev('eng_enqueued')\n"),
     ("        exc = fut.exception()\n        if exc is not None:\n            self.box.add(W.encode_error(rid, exc))", "        exc = fut.exception()\n        _ev('eng_done')\n        if exc is not None:\n            self.box.add(W.encode_error(rid, exc))"),
    ])
    patch("runtime/batcher.py", [
     ("                pending = launch([e.item for e in batch])", "                _ev('eng_launch0')\n                pending = launch([e.item for e in batch])\n                _ev('eng_launch1')"),
     ("                finally:\n                    rows = collect(pending)", "                finally:\n                    _ev('eng_ready')\n                    rows = collect(pending)\n                    _ev('eng_collected')"),
    ])
    patch("server/http/hotpath.py", [
     ("        if scope[\"type\"] != \"http\" or scope[\"method\"] != \"POST\" or not _watched(scope[\"path\"]):", "        _ev('fe_http')\n        if scope[\"type\"] != \"http\" or scope[\"method\"] != \"POST\" or not _watched(scope[\"path\"]):"),
     ("            plain = self._plain(scope, body)\n", "            _ev('fe_body')\n            plain = self._plain(scope, body)\n            _ev('fe_plain')\n"),
     ("            await _send_json(send, *self._payload(native, model, result))\n        return app", "            _ev('fe_result')\n            await _send_json(send, *self._payload(native, model, result))\n            _ev('fe_sent')\n        return app"),
    ], top="import orjson\n")
    # Plain requests are answered at the protocol (server/http/direct.py) since session 17: the same
    # events there (the ASGI hot path's above fire for the others).
    patch("server/http/direct.py", [
     ("        try:\n            data = orjson.loads(body)\n        except orjson.JSONDecodeError:\n            return proto.hand_back(body)",
      "        _ev('fe_http'); _ev('fe_body')\n        try:\n            data = orjson.loads(body)\n        except orjson.JSONDecodeError:\n            return proto.hand_back(body)"),
     ("        native, texts, service, model = plain\n", "        native, texts, service, model = plain\n        _ev('fe_plain')\n"),
     ("        payload, version, extra = self.hot._payload(native, model, result)\n        _respond(proto, cycle, 200, payload, version, extra)",
      "        _ev('fe_result')\n        payload, version, extra = self.hot._payload(native, model, result)\n        _respond(proto, cycle, 200, payload, version, extra)\n        _ev('fe_sent')"),
    ], top="import orjson\n")
    patch("server/state.py", [
     ("        timeout = self.config.limits.request_timeout_s\n        start = time.perf_counter_ns()", "        _ev('fe_call')\n        timeout = self.config.limits.request_timeout_s\n        start = time.perf_counter_ns()"),
    ], top="import asyncio\n")
    patch("runtime/service.py", [
     ("        is_text = texts is not None\n        options = options or EmbedOptions()", "        _ev('fe_embed')\n        is_text = texts is not None\n        options = options or EmbedOptions()"),
     ("        sub = [req.inputs[i] for i in miss]\n", "        sub = [req.inputs[i] for i in miss]\n        _ev('fe_tok0')\n"),
     ("        pooled = await self.batcher.submit(encs, req.deadline, req.priority, req.timings)", "        _ev('fe_tokenized')\n        pooled = await self.batcher.submit(encs, req.deadline, req.priority, req.timings)\n        _ev('fe_pooled')"),
    ], top="import asyncio\n")
    patch("runtime/worker.py", [
     ("        batch = self.make_batch(items)\n        return len(items), self.engines.launch(batch)", "        batch = self.make_batch(items)\n        _ev('eng_packed')\n        return len(items), self.engines.launch(batch)"),
    ])
    patch("engines/torch_launch.py", [
     ("        ids, types, pos, lengths = self._inputs(batch)\n        try:\n            with self.on_device():\n                return self._launch_cuda(ids, types, pos, lengths)", "        ids, types, pos, lengths = self._inputs(batch)\n        _ev('eng_checked')\n        try:\n            with self.on_device():\n                return self._launch_cuda(ids, types, pos, lengths)"),
     ("            n = self._stage_inputs(ids, types, pos, lengths, key, h_in)\n", "            _ev('eng_slot')\n            n = self._stage_inputs(ids, types, pos, lengths, key, h_in)\n            _ev('eng_staged')\n"),
     ("                        with torch.cuda.stream(self.stream):\n                            inputs.copy_(self._head(h_in, n), non_blocking=True)\n                            graph.replay()\n", "                        with torch.cuda.stream(self.stream):\n                            _ev('eng_ctx')\n                            inputs.copy_(self._head(h_in, n), non_blocking=True)\n                            _ev('eng_copied_in')\n                            graph.replay()\n                            _ev('eng_replayed')\n"),
     ("                            done.record(self.stream)\n                    else:", "                            _ev('eng_copy_out')\n                            done.record(self.stream)\n                        _ev('eng_recorded')\n                    else:"),
    ])
    print("traced tree at", dest)


def report(d: str) -> None:
    evs = []
    for f in glob.glob(f"{d}/ev.*"):
        pid = f.rsplit(".", 1)[1]
        for line in open(f):
            n, t = line.split()
            evs.append((int(t), n, pid))
    evs.sort()
    reqs, cur = [], None
    for t, n, pid in evs:
        if n == "fe_http":
            cur = [(t, n)]
            reqs.append(cur)
        elif cur is not None:
            cur.append((t, n))
    gaps = collections.defaultdict(list)
    order = {}
    total = []
    for r in reqs[len(reqs) // 10:]:  # skip warm-up
        for (t0, a), (t1, b) in zip(r, r[1:]):
            key = f"{a} -> {b}"
            gaps[key].append(t1 - t0)
            order.setdefault(key, len(order))
        total.append(r[-1][0] - r[0][0])
    if not total:
        raise SystemExit(f"no traced requests in {d} (ev.* files of a traced server, one client)")
    print(f"requests {len(total)}, fe_http -> last event p50 {statistics.median(total)/1e3:.1f} us")
    for k in sorted(gaps, key=order.get):
        v = gaps[k]
        if len(v) >= len(total) * 0.5:
            print(f"{k:34s} p50 {statistics.median(v)/1e3:8.1f} us  (n={len(v)})")


if __name__ == "__main__":
    cmd, arg = sys.argv[1:3]
    make(Path(arg)) if cmd == "make" else report(arg)

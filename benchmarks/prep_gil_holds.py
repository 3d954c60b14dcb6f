"""How long a large body's preparation holds the GIL (and so the event loop) in one go, step by step, in process.

    python3 benchmarks/prep_gil_holds.py [--tree CHECKOUT] [--rounds 3]

For each request shape (~1.6-1.9 MB of JSON), the real decode and validation of its route (common.checked_json
with the route's model; for KServe infer also the tensors' decode, kserve.decode_inputs + decode_request) runs on
one thread while a ticker thread sleeps 0.5 ms in a loop; the ticker's longest gap is the longest time the work
kept the GIL (a native call that never lets it go), which an event loop on another thread would wait. The heap
alive before is frozen (gc.freeze), as a serving process's is (runtime/gc_settle.py). `--tree`: import surge from
that checkout's src (e.g. main's, for a before / after). Reported: the work's time and the longest gap (medians).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def longest_hold(fn) -> tuple[float, float]:
    """(ms fn took, ms of the ticker's longest gap while it ran)."""
    stop, gaps = threading.Event(), []

    def tick():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    th = threading.Thread(target=tick)
    th.start()
    time.sleep(0.02)
    t0 = time.perf_counter()
    try:
        fn()
    except Exception:  # noqa: BLE001, S110 - a refused request is prepared until its error, as the route's
        pass
    took = time.perf_counter() - t0
    stop.set()
    th.join()
    return 1e3 * took, 1e3 * max(gaps)


def shapes():
    """name -> a call preparing that body as its route does (decode and validate, and the tensors' decode)."""
    import orjson

    from surge.server import kserve_contract as contract
    from surge.server.http import kserve
    from surge.server.http.common import checked_json, validate
    from surge.server.http.native import EmbedRequest
    from surge.server.http.openai import EmbeddingsRequest
    from surge.server.http.openai_chat_requests import ChatCompletionRequest, CompletionRequest

    turns = [{"role": "user" if k % 2 == 0 else "assistant", "content": f"turn {k}"} for k in range(45_000)]
    bodies = {
        "completions, 900k-id prompt": (CompletionRequest, {"model": "m", "prompt": [7] * 900_000, "max_tokens": 1}),
        "chat, 45k messages": (ChatCompletionRequest, {"model": "m", "messages": turns, "max_tokens": 1}),
        "/v1/embeddings, 2048 x 400 ids": (EmbeddingsRequest, {"model": "m", "input": [[7] * 400] * 2048}),
        "/embed, 2048 x 400 ids": (EmbedRequest, {"inputs": [[7] * 400] * 2048}),
        "/v1/embeddings, 2048 texts": (EmbeddingsRequest, {"model": "m", "input": ["word " * 180] * 2048}),
    }
    out = {}
    for name, (model, body) in bodies.items():
        raw = orjson.dumps(body)
        out[name] = (len(raw), lambda raw=raw, model=model: checked_json(lambda d: validate(model, d), raw))
    infer = orjson.dumps({"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [2048, 400],
                                      "data": [7] * (2048 * 400)}]})
    req = checked_json(lambda d: kserve._validate(kserve._InferRequest, d), infer)
    out["KServe infer, 2048 x 400 ids: tensors' decode"] = (len(infer), lambda: contract.decode_request(
        kserve.decode_inputs(req.inputs, b""), {}, [], 2048, 20_000))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", type=Path, default=ROOT)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(args.tree.resolve() / "src"))
    import surge.server.app  # noqa: F401 - the web stack's objects alive, as in a server

    table = shapes()
    gc.collect()
    gc.freeze()
    print(f"tree: {args.tree}; medians of {args.rounds}")
    print("| body | KB | prepared in ms | longest GIL hold ms |\n| --- | ---: | ---: | ---: |")
    for name, (size, fn) in table.items():
        runs = [longest_hold(fn) for _ in range(args.rounds)]
        print(f"| {name} | {size / 1024:.0f} | {statistics.median(r[0] for r in runs):.1f} | "
              f"{statistics.median(r[1] for r in runs):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

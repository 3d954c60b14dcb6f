"""How long one large generation request holds the server's event loop: probes answered during it.

    PYTHONPATH=src python3 benchmarks/loop_stall.py --rounds 3 [--baseline CHECKOUT] [--kinds bad_words_chat ...]

`surge serve` of a tiny random decoder (tests/decoder_models.py; its engine loop in a process of its own,
the default). A probe process sends GET /health back to back on one keep-alive connection (a 1 ms pause
between probes) and records each probe's send and answer times. For each kind of large request (~1-2 MB of
JSON, under the 2 MiB body limit) the main process sends it on a connection of its own (the body encoded
beforehand) and waits for its answer; the probes whose time on the wire overlaps the large request's are
its "during" sample, those of an equally long quiet window just before it the "quiet" one. Reported: the
large request's own latency, and the probes' p99 and max latency during it and quiet (medians over
`--rounds`). A stalled loop shows as a probe max near the large request's whole time.

Kinds whose path starts with "embed:" go to a second server, started only when one of them is measured: `surge
serve` of a tiny decoder embedding model (tests/decoder_models.build_embedding_model, last-token pooling, 48
tokens, `--allow-token-ids --auto-truncate`), for embedding batches of many inputs and KServe infer tensors.
The gRPC kind's status is its gRPC code's number (0 OK). `--baseline CHECKOUT` (e.g. `git archive main | tar -x -C /tmp/base`) measures that checkout's server too,
rounds alternating with this one's, so both see the machine as it was; `--baseline-env K=V ...` measures a
baseline server started with those environment variables (of this checkout, or of --baseline's), e.g.
`--baseline-env SURGE_GC_FREEZE=0`; `--env K=V ...` sets variables for this checkout's servers.
`--gc-trace`: the servers run benchmarks/gc_trace/sitecustomize.py, which times each garbage collection of
each process; reported too: the front end's full (generation 2) collections during the large request, their
count, longest and total ms, and its longest collection of any generation (medians over the rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

NAME = "m"
EMBED = "e"
ASK = [{"role": "user", "content": "hi"}]


def _turns(n: int) -> list[dict]:
    return [{"role": "user" if k % 2 == 0 else "assistant", "content": f"turn {k}"} for k in range(n)]


def _grammar(rules: int) -> str:
    return ("start: " + " ".join(f"r{i}" for i in range(rules)) + "\n"
            + "\n".join(f'r{i}: "a"' for i in range(rules)))


def _bias(entries: int) -> dict:
    # the tiny model has 384 tokens: zero-padded keys name the same ids ("7", "07", ...), as int() reads them
    out, width = {}, 1
    while len(out) < entries:
        for t in range(384):
            out[str(t).zfill(width)] = 1.0
        width += 1
    return dict(list(out.items())[:entries])


def _infer(sampling: dict) -> dict:
    """A KServe v2 inference request of Triton's vLLM backend (server/kserve_generate_infer.py)."""
    return {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]},
                       {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1],
                        "data": [json.dumps(sampling)]}]}


def _grpc_infer(body: dict) -> bytes:
    """`body` (_infer's) as an encoded gRPC ModelInferRequest."""
    from surge.server.grpc import grpc_service_pb2 as pb

    req = pb.ModelInferRequest(model_name=NAME)
    for t in body["inputs"]:
        req.inputs.add(name=t["name"], datatype=t["datatype"], shape=t["shape"]).contents.bytes_contents.extend(
            v.encode() for v in t["data"])
    return req.SerializeToString()


def kinds() -> dict[str, tuple[str, dict]]:
    """name -> (path, body): each ~1-2 MB of JSON. (Stop strings are bounded already: 16 of 1,024 characters.)
    A path "grpc:METHOD" is that gRPC call, its body _infer's."""
    bad = [f"w{i}" for i in range(100_000)]
    return {
        "bad_words_completions": ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1,
                                                      "bad_words": bad}),
        "bad_words_chat": ("/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 1,
                                                    "bad_words": bad}),
        "bad_words_kserve": (f"/v2/models/{NAME}/generate", {"text_input": "hi", "parameters": {
            "max_tokens": 1, "bad_words": bad}}),
        "chat_45k_messages": ("/v1/chat/completions", {"model": NAME, "messages": _turns(45_000),
                                                       "max_tokens": 1}),
        "responses_45k_turns": ("/v1/responses", {"model": NAME, "input": _turns(45_000), "max_output_tokens": 1,
                                                  "store": False}),
        "messages_45k_turns": ("/v1/messages", {"model": NAME, "messages": _turns(45_000), "max_tokens": 1}),
        "grammar_1.5MB": ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1,
                                              "guided_grammar": _grammar(80_000)}),
        "prompt_text_1.9MB": ("/v1/completions", {"model": NAME, "prompt": "word " * 380_000, "max_tokens": 1}),
        "prompt_ids_900k": ("/v1/completions", {"model": NAME, "prompt": [7] * 900_000, "max_tokens": 1}),
        "logit_bias_35k": ("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1,
                                               "logit_bias": _bias(35_000)}),
        "tokenize_prompt_1.9MB": ("/tokenize", {"model": NAME, "prompt": "word " * 380_000}),
        "tokenize_45k_messages": ("/tokenize", {"model": NAME, "messages": _turns(45_000)}),
        # a special token (13 characters a token): the decode, not the parse, is most of the work
        "detokenize_900k_ids": ("/detokenize", {"model": NAME, "tokens": [0] * 900_000}),
        "tei_decode_900k_ids": ("/decode", {"model": NAME, "ids": [0] * 900_000, "skip_special_tokens": False}),
        "count_tokens_45k_turns": ("/v1/messages/count_tokens", {"model": NAME, "messages": _turns(45_000)}),
        "count_tokens_1.9MB_message": ("/v1/messages/count_tokens", {"model": NAME, "messages": [
            {"role": "user", "content": "word " * 380_000}]}),
        "bad_words_kserve_infer": (f"/v2/models/{NAME}/infer", _infer({"max_tokens": 1, "bad_words": bad})),
        "bad_words_grpc_infer": ("grpc:ModelInfer", _infer({"max_tokens": 1, "bad_words": bad})),
        # the embedding server's (embed:): 2,048 inputs (OpenAI's limit) of 400 ids, truncated to the model's 48
        "embeddings_2048x400_ids": ("embed:/v1/embeddings", {"model": EMBED, "input": [[7] * 400] * 2048}),
        "embed_2048x400_ids": ("embed:/embed", {"inputs": [[7] * 400] * 2048}),
        "embeddings_2048_texts": ("embed:/v1/embeddings", {"model": EMBED, "input": ["word " * 180] * 2048}),
        "kserve_infer_ids_2048x400": (f"embed:/v2/models/{EMBED}/infer", {"inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": [2048, 400], "data": [7] * (2048 * 400)}]}),
        "kserve_infer_texts_2048": (f"embed:/v2/models/{EMBED}/infer", {"inputs": [
            {"name": "text", "datatype": "BYTES", "shape": [2048], "data": ["word " * 180] * 2048}]}),
    }


def _probe(port: int, stop, out) -> None:
    """GET /health back to back until `stop`; sends [(sent, answered)] (time.monotonic, system-wide)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    times = []
    while not stop.is_set():
        t0 = time.monotonic()
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        times.append((t0, time.monotonic()))
        time.sleep(0.001)
    conn.close()
    out.send(times)


class Prober:
    def __init__(self, port: int):
        self.stop, (self.recv, send) = mp.Event(), mp.Pipe(duplex=False)
        self.proc = mp.Process(target=_probe, args=(port, self.stop, send), daemon=True)
        self.proc.start()

    def finish(self) -> list[tuple[float, float]]:
        self.stop.set()
        times = self.recv.recv()
        self.proc.join()
        return times


def _post(srv, path: str, payload: bytes) -> tuple[int, float, float]:
    path = path.removeprefix("embed:")
    if path.startswith("grpc:"):
        return _call(srv.grpc_port, path[len("grpc:"):], payload)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
    t0 = time.monotonic()
    conn.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    t1 = time.monotonic()
    conn.close()
    return r.status, t0, t1


def _call(port: int, method: str, payload: bytes) -> tuple[int, float, float]:
    """(gRPC status code's value, start, end) of one call of an encoded request."""
    import grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")  # bytes in, bytes out
        grpc.channel_ready_future(channel).result(timeout=30)
        t0 = time.monotonic()
        try:
            call(payload, timeout=300)
            code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            code = exc.code()
        return code.value[0], t0, time.monotonic()


def _stats(times, start, end) -> tuple[float, float, int]:
    """(p99 ms, max ms, count) of the probes on the wire during [start, end]."""
    lat = sorted(1e3 * (b - a) for a, b in times if a < end and b > start)
    if not lat:
        return float("nan"), float("nan"), 0
    return lat[min(len(lat) - 1, int(0.99 * len(lat)))], lat[-1], len(lat)


def _collections(srv, start: float, end: float) -> dict:
    """The front end's collections (benchmarks/gc_trace) that began during [start, end]."""
    log = Path(srv.gc_trace) / f"{srv.proc.pid}.jsonl"
    time.sleep(0.3)  # the hook writes every 0.2 s
    recs = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    during = [r for r in recs if "t" in r and start <= r["t"] <= end]
    full = [r["ms"] for r in during if r["gen"] == 2]
    return {"full_gcs": len(full), "full_gc_max_ms": max(full, default=0.0), "full_gc_total_ms": sum(full),
            "gc_max_ms": max((r["ms"] for r in during), default=0.0)}


def one_round(srv, path: str, payload: bytes) -> dict:
    prober = Prober(srv.port)
    time.sleep(0.3)  # the probe's connection is up
    status, t0, t1 = _post(srv, path, payload)  # first: how long the quiet window must be
    quiet_start = time.monotonic()
    time.sleep(t1 - t0)
    quiet_end = time.monotonic()
    status, s0, s1 = _post(srv, path, payload)
    time.sleep(0.05)
    times = prober.finish()
    q99, qmax, _ = _stats(times, quiet_start, quiet_end)
    d99, dmax, n = _stats(times, s0, s1)
    return {"status": status, "request_ms": 1e3 * (s1 - s0), "quiet_p99": q99, "quiet_max": qmax,
            "during_p99": d99, "during_max": dmax, "probes_during": n,
            **(_collections(srv, s0, s1) if getattr(srv, "gc_trace", None) else {})}


def _env_pairs(pairs: list[str]) -> dict:
    return dict(p.split("=", 1) for p in pairs)


def main(argv=None) -> int:
    from surge.bench.servers import ServerProc, free_port
    from tests.decoder_models import build_embedding_model, build_model

    table = kinds()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kinds", nargs="*", default=list(table), choices=list(table))
    ap.add_argument("--baseline", type=Path, help="another checkout, measured alternately (its server's numbers "
                    "are the 'baseline' rows)")
    ap.add_argument("--baseline-env", nargs="*", default=[], metavar="K=V",
                    help="a baseline server with these environment variables (of --baseline's checkout, or this one)")
    ap.add_argument("--env", nargs="*", default=[], metavar="K=V", help="environment variables of this checkout's servers")
    ap.add_argument("--gc-trace", action="store_true", help="time the front end's garbage collections too")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    roots = {"this": ROOT, **({"baseline": (args.baseline or ROOT).resolve()}
                              if args.baseline or args.baseline_env else {})}
    envs = {"this": _env_pairs(args.env), "baseline": _env_pairs(args.baseline_env)}
    rows: dict = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        def server_env(variant: str, root: Path, name: str) -> dict:
            env = {"PYTHONPATH": str(root / "src"), **envs[variant]}
            if args.gc_trace:  # the hook from this checkout, whichever checkout serves
                env["PYTHONPATH"] = f"{ROOT / 'benchmarks' / 'gc_trace'}:{env['PYTHONPATH']}"
                env["SURGE_GC_TRACE"] = str(Path(tmp) / "gc" / f"{name}-{variant}")
            return env

        def traced(srv, env: dict):
            srv.gc_trace = env.get("SURGE_GC_TRACE")
            return srv

        model = build_model("qwen2", Path(tmp) / NAME, seed=5)
        servers, embedders = {}, {}
        if any(table[k][0].startswith("embed:") for k in args.kinds):
            embed_model = build_embedding_model("qwen3", Path(tmp) / EMBED, seed=4)
            for variant, root in roots.items():
                port = free_port()
                cmd = [sys.executable, "-m", "surge.cli.main", "serve", str(embed_model), "--port", str(port),
                       "--grpc-port", str(free_port()), "--threads", "1", "--model-name", EMBED, "--allow-token-ids", "--auto-truncate"]
                env = server_env(variant, root, "embed")
                embedders[variant] = traced(stack.enter_context(ServerProc(
                    f"surge-serve embed ({variant})", cmd, port, cwd=root, env=env)), env)
        for variant, root in roots.items():
            port, grpc_port = free_port(), free_port()
            cmd = [sys.executable, "-m", "surge.cli.main", "serve", str(model), "--port", str(port), "--grpc-port",
                   str(grpc_port), "--threads", "1", "--model-name", NAME, "--generation", "cache_entries=0"]
            env = server_env(variant, root, "generate")
            servers[variant] = traced(stack.enter_context(ServerProc(f"surge-serve ({variant})", cmd, port, cwd=root,
                                                                     env=env)), env)
            servers[variant].grpc_port = grpc_port
        for name in args.kinds:
            path, body = table[name]
            payload = _grpc_infer(body) if path.startswith("grpc:") else \
                json.dumps(body, separators=(",", ":")).encode()
            targets = embedders if path.startswith("embed:") else servers
            per = {v: [] for v in targets}
            for _ in range(args.rounds):
                for variant, srv in targets.items():  # alternating: the machine's drift hits both
                    per[variant].append(one_round(srv, path, payload))
            for variant, rounds in per.items():
                row = {k: statistics.median(r[k] for r in rounds)
                       for k in ("request_ms", "quiet_p99", "quiet_max", "during_p99", "during_max", "probes_during",
                                 "full_gcs", "full_gc_max_ms", "full_gc_total_ms", "gc_max_ms") if k in rounds[0]}
                row["status"] = rounds[-1]["status"]
                row["body_kb"] = len(payload) / 1024
                rows[f"{name} ({variant})"] = row
                print(f"{name} ({variant}): " + json.dumps({k: round(v, 2) for k, v in row.items()}), flush=True)
    print(f"\nprobes (GET /health) during one large request vs a quiet window as long, medians of {args.rounds} "
          f"rounds, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          + (f"; baseline: {args.baseline or 'this checkout'} {' '.join(args.baseline_env)}".rstrip()
             if "baseline" in roots else "") + (f"; this: {' '.join(args.env)}" if args.env else ""))
    print("| request | body KB | status | its latency ms | probe p99 quiet ms | probe max quiet ms | "
          "probe p99 during ms | probe max during ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        print(f"| {name} | {r['body_kb']:.0f} | {r['status']} | {r['request_ms']:.0f} | {r['quiet_p99']:.1f} | "
              f"{r['quiet_max']:.1f} | {r['during_p99']:.1f} | {r['during_max']:.1f} |")
    if args.gc_trace:
        print("\nthe front end's garbage collections during the large request (medians)")
        print("| request | full collections | longest full ms | full ms in all | longest of any generation ms |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, r in rows.items():
            print(f"| {name} | {r['full_gcs']:g} | {r['full_gc_max_ms']:.1f} | {r['full_gc_total_ms']:.1f} | "
                  f"{r['gc_max_ms']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Generation through a real `surge serve` process against the same service in-process.

    PYTHONPATH=src python3 benchmarks/generate_http.py --device cuda --shape qwen2-0.5b --rounds 5
    PYTHONPATH=src python3 benchmarks/generate_http.py --device cpu --shape gpt2-tiny --streams 8 --output 16

benchmarks/generate.py measures the decoder service in-process (GenerateService.stream, token ids
out). What a user gets goes further: HTTP parsing, detokenization, one SSE chunk per delivery. Here
the same random-weight model (generate.py's shapes) gets a word-level tokenizer covering its whole
vocabulary, so every generated token decodes to text as a real one would, and:

* **http thread / http process**: `surge serve MODEL` with its engine loop on a thread of the server
  (`--generation engine_process=false`) or in a process of its own (`engine_process=true`, the GPU's
  default); `--clients` load-generator processes share `--streams` concurrent streaming
  `/v1/completions` requests (token-id prompts, greedy, EOS ignored, usage in the last chunk). All
  streams of a round start together; tok/s = completion tokens (from usage) over the round's wall
  time; TTFT and the gap between chunks per stream; the server's own TTFT from its /metrics.
* **in-process thread**: `load_generate_service` (what the server builds) with the same settings and
  the loop on a thread, driven through `GenerateService.stream` in this process, detokenizing: what
  benchmarks/generate.py measures, plus detokenization.

`--background N --background-output M` (joining): before the measured rounds, N more streams of M tokens start
(one more client process), each asked again as soon as it ends, so N streams decode throughout and each round's
requests join a running batch; the rounds then follow each other at once, and the TTFT of every round's requests is
also given pooled (p50 / p99 / max).

Every round prints; the table has medians and the ratio to in-process; --plot draws the CDFs of TTFT
and of the gaps between a stream's chunks for every path. `--engine thread|process`
picks the server variants (default both); `--workers N` adds `surge serve --workers N` (N front
ends sharing the engine process's loop, runtime/generate_hub.py); --server-arg passes extra flags
to the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def word_tokenizer(out: Path, vocab: int, eos_id: int) -> None:
    """tokenizer.json: word level, token i <-> "w{i}", the eos id named as one (decode skips it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    eos = f"w{eos_id}"
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": "w0", "pad_token": "w0"}))


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


def summarize(per_stream: list[dict], wall: float) -> dict:
    tokens = sum(s["tokens"] for s in per_stream)
    ttft = [s["ttft"] for s in per_stream]
    gaps = [g for s in per_stream for g in s["gaps"]]
    # a request's second chunk and its whole answer (from its submission)
    second = [s["ttft"] + s["gaps"][0] for s in per_stream if s["gaps"]]
    answer = [s["end"] - s["start"] for s in per_stream]
    return {"tok_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "gap_p50_ms": 1e3 * pct(gaps, 50), "gap_p99_ms": 1e3 * pct(gaps, 99),
            # the samples, for --plot
            "ttft_ms": [round(1e3 * t, 3) for t in ttft], "gaps_ms": [round(1e3 * g, 3) for g in gaps],
            "second_ms": [round(1e3 * t, 3) for t in second], "answer_ms": [round(1e3 * t, 3) for t in answer]}


# -- the load generator (its own processes) -------------------------------------------------------------
async def _client_round(url: str, model: str, prompts: list[list[int]], n_out: int, start_at: float) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one(p):
            body = {"model": model, "prompt": p, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.time()
            first = last = None
            gaps, tokens = [], 0
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.time()
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    if not chunk.get("choices"):
                        continue
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
            return {"ttft": first - t0, "gaps": gaps, "tokens": tokens, "start": t0, "end": last}

        # a connection each, opened before the clock starts
        await asyncio.gather(*(client.get("/health") for _ in prompts))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await asyncio.gather(*(one(p) for p in prompts))


def _client_main(url, model, prompts, n_out, rounds, conn):
    for _ in range(rounds):
        start_at = conn.recv()
        conn.send(asyncio.run(_client_round(url, model, prompts, n_out, start_at)))
    conn.close()


def _background_main(url, model, prompts, n_out, conn):
    """Every prompt a stream of n_out tokens, asked again as soon as it ends, until conn says stop; then
    the streams' count is sent back."""
    import httpx

    async def main():
        done, stop = [0], asyncio.Event()

        async def one(client, p):
            body = {"model": model, "prompt": p, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            while not stop.is_set():
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                    async for _ in r.aiter_lines():
                        pass
                done[0] += 1

        async def watch():
            while not conn.poll():
                await asyncio.sleep(0.05)
            stop.set()

        limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            await asyncio.gather(watch(), *(one(client, p) for p in prompts))
        return done[0]

    try:
        conn.send(asyncio.run(main()))
    except Exception as exc:  # noqa: BLE001 (told to the parent, which stops)
        conn.send(f"{type(exc).__name__}: {exc}")


def server_ttft(url: str) -> tuple[float, float, float, float]:
    """(sum, count) of the server's time-to-first-token histogram, its output tokens so far (every stream's,
    the background's too) and when they were read (time.perf_counter())."""
    import httpx

    total = count = tokens = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("surge_generate_time_to_first_token_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("surge_generate_time_to_first_token_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("surge_generate_output_tokens_total"):
            tokens += float(line.rsplit(" ", 1)[1])
    return total, count, tokens, time.perf_counter()


def server_stages(url: str, model: str) -> dict:
    """{stage: (ns, count)} of the model's KServe statistics: queue (submitted -> first scheduled by the
    engine), compute_input (-> first token back at the server), compute_infer (the decode)."""
    import httpx

    (m,) = httpx.get(f"{url}/v2/models/{model}/stats", timeout=30).json()["model_stats"]
    s = m["inference_stats"]
    return {k: (s[k]["ns"], s[k]["count"]) for k in ("queue", "compute_input", "compute_infer")}


def http_rounds(url: str, model: str, prompts, n_out: int, rounds: int, clients: int,
                warm_clients: bool = False) -> list[dict]:
    """`warm_clients`: rounds after the first start at once (the clients' imports and connections are done)."""
    ctx = mp.get_context("spawn")
    shares = [prompts[i::clients] for i in range(clients)]
    pipes, procs = [], []
    for share in shares:
        a, b = ctx.Pipe()
        p = ctx.Process(target=_client_main, args=(url, model, share, n_out, rounds, b), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    out = []
    for i in range(rounds):
        before, stages0 = server_ttft(url), server_stages(url, model)
        # the clients' imports and connections are done by then
        start_at = time.time() + (0.05 if warm_clients and i else 1.5)
        for a in pipes:
            a.send(start_at)
        streams = [s for a in pipes for s in a.recv()]
        wall = max(s["end"] for s in streams) - start_at
        after, stages1 = server_ttft(url), server_stages(url, model)
        r = summarize(streams, wall)
        # the server's TTFT split: waiting for the engine to schedule it, then the prefill and the token's
        # way back (of the front end that answered /stats: under --workers one front end's share)
        for k in ("queue", "compute_input"):
            ns, n = (stages1[k][0] - stages0[k][0]), (stages1[k][1] - stages0[k][1])
            r[f"server_{k}_mean_ms"] = ns / 1e6 / max(1, n)
        # the server's own TTFT (from the stream's submission to its first token): the rest of the
        # client's is HTTP and the event loop
        r["server_ttft_mean_ms"] = 1e3 * (after[0] - before[0]) / max(1.0, after[1] - before[1])
        # what the whole server delivered meanwhile (with --background: mostly the running streams)
        r["server_tok_s"] = (after[2] - before[2]) / max(1e-9, after[3] - before[3])
        r["send_spread_ms"] = 1e3 * (max(s["start"] for s in streams) - min(s["start"] for s in streams))
        out.append(r)
    for p in procs:
        p.join(10)
    return out


# -- in-process -----------------------------------------------------------------------------------------
async def _inproc_round(service, prompts, n_out):
    from surge.runtime.scheduler import SamplingParams

    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)

    async def one(p):
        t0 = time.perf_counter()
        first = last = None
        gaps, tokens, text = [], 0, []
        async for d in service.stream(p, params, deadline=time.monotonic() + 600):
            now = time.perf_counter()
            text.append(d.text)  # detokenized, as the server's chunks carry it
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
            tokens = d.completion_tokens
        return {"ttft": first - t0, "gaps": gaps, "tokens": tokens, "start": t0, "end": last}

    t0 = time.perf_counter()
    streams = await asyncio.gather(*(one(p) for p in prompts))
    return summarize(streams, max(s["end"] for s in streams) - t0)


def inproc_rounds(path: Path, args, prompts) -> list[dict]:
    from surge.runtime.generate_load import load_generate_service

    service = load_generate_service(path, "bench", device=args.device, precision=args.dtype,
                                    config=inproc_config(args), request_timeout_s=600)
    service.mark_ready()

    async def main():
        await _inproc_round(service, prompts[:8], 4)
        rounds = []
        for i in range(args.rounds):
            rounds.append(await _inproc_round(service, prompts, args.output))
            print(f"  in-process round {i + 1}: {fmt(rounds[-1])}", flush=True)
        await service.close()
        return rounds

    return asyncio.run(main())


def generation_fields(args) -> dict:
    max_len = args.prompt + max(args.output, args.background_output if args.background else 0) + 16
    n = args.streams + args.background
    return dict(max_num_seqs=n, max_num_batched_tokens=args.budget, max_model_len=max_len,
                kv_cache_tokens=(n + 8) * max_len, cache_entries=0, prefix_caching=False)


def inproc_config(args):
    """The in-process reference: the engine loop on a thread, as benchmarks/generate.py drives it."""
    from surge.config import GenerationConfig

    return GenerationConfig(**generation_fields(args), engine_process=False)


def fmt(r: dict) -> str:
    more = (f"; server's TTFT mean {r['server_ttft_mean_ms']:.1f} ms (queue {r['server_queue_mean_ms']:.1f} + "
            f"prefill and back {r['server_compute_input_mean_ms']:.1f}), sends spread over {r['send_spread_ms']:.1f} ms"
            if "server_ttft_mean_ms" in r else "")
    return (f"{r['tok_s']:,.0f} tok/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms, gap p50/p99 {r['gap_p50_ms']:.2f} / "
            f"{r['gap_p99_ms']:.2f} ms{more}")


def serve_rounds(path: Path, args, prompts, fields: dict, mode: str) -> list[dict]:
    """`surge serve` on the model with the engine loop on a thread or in its own process (`mode` thread /
    process), or behind N front ends (`workers N`: the engine process runs it): a warm-up round, then
    the measured ones."""
    from surge.bench.servers import ServerProc, free_port

    port = free_port()
    gen = ",".join(f"{k}={v}" for k, v in {**fields, "engine_process": mode == "process"}.items())
    workers = ["--workers", mode.split()[1]] if mode.startswith("workers") else []
    argv = [sys.executable, "-m", "surge.cli.main", "serve", str(path), "--port", str(port), "--grpc-port",
            "0", "--device", args.device, "--precision", args.dtype, "--model-name", "bench",
            "--generation", gen, *workers, *args.server_arg]
    print("server:", " ".join(argv[2:]), flush=True)
    pythonpath = os.pathsep.join(x for x in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if x)
    srv = ServerProc("surge-serve", argv, port, ready_timeout_s=600, cwd=ROOT, env={"PYTHONPATH": pythonpath})
    t = time.perf_counter()
    srv.start()
    print(f"server ready in {time.perf_counter() - t:.1f} s", flush=True)
    try:
        http_rounds(srv.url, "bench", prompts[:8], 4, 1, 1)  # warm-up
        background = None
        if args.background:  # streams decoding throughout (each asked again when it ends), which the rounds join
            ctx = mp.get_context("spawn")
            a, b = ctx.Pipe()
            bg = [[(7 * i + j) % 1000 + 2 for j in range(args.prompt)] for i in range(args.background)]
            background = ctx.Process(target=_background_main, args=(srv.url, "bench", bg, args.background_output, b),
                                     daemon=True)
            background.start()
            time.sleep(4.0)  # imported, connected, decoding
            if a.poll():
                raise RuntimeError(f"the background streams stopped: {a.recv()}")
        rounds = http_rounds(srv.url, "bench", prompts, args.output, args.rounds, args.clients,
                             warm_clients=bool(args.background))
        if background is not None:
            a.send("stop")
            got = a.recv() if a.poll(120) else "no answer"
            print(f"  background: {args.background} streams of {args.background_output} tokens asked again as they "
                  f"ended: {got} streams", flush=True)
            background.join(10)
    finally:
        srv.stop()
    for i, r in enumerate(rounds):
        print(f"  http ({mode}) round {i + 1}: {fmt(r)}", flush=True)
    return rounds


def _panels(series: dict) -> dict:
    """{panel: {series: samples}}: TTFT, the gaps between chunks and (in records that have it) the whole answer,
    every round's samples pooled; `series` maps a label to its rounds."""
    def pooled(key):
        return {n: [v for r in rs for v in r.get(key, [])] for n, rs in series.items()}

    panels = {"time to first token": pooled("ttft_ms"), "gap between a stream's chunks": pooled("gaps_ms")}
    answer = pooled("answer_ms")
    if any(answer.values()):
        panels["a request's whole answer"] = answer
    return panels


def plot_records(paths: list[Path], out: Path) -> int:
    """TTFT and chunk-gap CDFs of saved records (e.g. one run a server setting), a series a record's path."""
    from surge.bench.plots import sample_cdfs

    records = [json.loads(path.read_text()) for path in paths]
    lengths = {r.get("output") for r in records}
    series = {}
    for record in records:
        tokens = f", {record['output']} tokens" if len(lengths) > 1 else ""  # records of several answer lengths
        for name in record.get("medians", {}):
            series[f"{name} {' '.join(record.get('server_args', []))}".strip() + tokens] = record[name]
    sample_cdfs(_panels(series), out, f"{records[-1]['shape']}, {records[-1]['streams']} streams a round")
    print(f"plot: {out}")
    return 0


def main(argv=None) -> int:
    import generate as G
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--shape", default=None, choices=sorted(G.SHAPES))
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=8, help="load-generator processes")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `surge serve` flag (repeatable)")
    ap.add_argument("--engine", action="append", choices=["thread", "process"],
                    help="where the server runs the engine loop (repeatable; default both)")
    ap.add_argument("--workers", action="append", type=int, default=[],
                    help="also `surge serve --workers N` (repeatable): N front ends sharing the engine process's loop")
    ap.add_argument("--background", type=int, default=0, help="streams decoding throughout that the rounds' "
                    "requests join (over HTTP servers only: implies --skip-inproc)")
    ap.add_argument("--background-output", type=int, default=2000, help="tokens each background stream asks for")
    ap.add_argument("--skip-inproc", action="store_true")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path, help="PNG: CDFs of TTFT and of the gap between chunks, every path")
    ap.add_argument("--plot-from", type=Path, nargs="+", help="with --plot: the CDFs of saved --json records (each "
                    "path of each record a series, named by its --server-arg), no server run")
    args = ap.parse_args(argv)
    if args.plot_from:
        return plot_records(args.plot_from, args.plot)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    args.engine = args.engine or ["thread", "process"]
    args.skip_inproc = args.skip_inproc or bool(args.background)
    shape = args.shape or ("qwen2-0.5b" if args.device.startswith("cuda") else "gpt2-tiny")
    record = {"shape": shape, "device": args.device, "streams": args.streams, "prompt": args.prompt,
              "output": args.output, "server_args": args.server_arg}
    with tempfile.TemporaryDirectory() as tmp:
        path = G.build(shape, Path(tmp) / shape, "cpu")
        vocab = G.SHAPES[shape][1].get("vocab_size", 1000)
        word_tokenizer(path, vocab, eos_id=1)
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(2, vocab, (args.streams, args.prompt), generator=g).tolist()
        fields = generation_fields(args)
        for mode in args.engine + [f"workers {n}" for n in args.workers]:
            record[f"http {mode}"] = serve_rounds(path, args, prompts, fields, mode)
        if not args.skip_inproc:
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            record["in-process thread"] = inproc_rounds(path, args, prompts)
    print(f"\n{shape} ({args.device}, {args.dtype}): {args.streams} streams, {args.prompt}-token prompts, "
          f"{args.output} output tokens, medians of {args.rounds} rounds; the engine loop on a thread of the "
          "server or in a process of its own (GenerationConfig.engine_process), or behind N front ends (--workers)")
    print("| path | output tok/s | TTFT p50 / p99 ms | server's TTFT mean ms (queue + prefill and back) | gap "
          "between chunks p50 / p99 ms | vs in-process |")
    print("| --- | ---: | --- | ---: | --- | ---: |")
    med = {}
    for name in [k for k in record if k.startswith("http ")] + ["in-process thread"]:
        if name not in record:
            continue
        rs = record[name]
        med[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if not isinstance(rs[0][k], list)}
    base = med.get("in-process thread")
    for name, m in med.items():
        ratio = f"{m['tok_s'] / base['tok_s']:.2f}" if base else "-"
        server = (f"{m['server_ttft_mean_ms']:.1f} ({m['server_queue_mean_ms']:.1f} + "
                  f"{m['server_compute_input_mean_ms']:.1f})" if "server_ttft_mean_ms" in m else "-")
        print(f"| {name} | {m['tok_s']:,.0f} | {m['ttft_p50_ms']:.1f} / {m['ttft_p99_ms']:.1f} | {server} | "
              f"{m['gap_p50_ms']:.2f} / {m['gap_p99_ms']:.2f} | {ratio} |")
    record["medians"] = med
    if args.background:
        print(f"\njoining {args.background} decoding streams: every round's requests pooled")
        print("| path | requests | TTFT p50 / p99 / max ms | second chunk p50 / p99 ms | whole answer p50 / p99 ms | "
              "gap between chunks p50 / p99 ms | server's output tok/s (median of rounds) |")
        print("| --- | ---: | --- | --- | --- | --- | ---: |")
        for name in med:
            rs = [r for r in record[name] if "second_ms" in r]
            ttft = [t for r in rs for t in r["ttft_ms"]]
            gaps = [g for r in rs for g in r["gaps_ms"]]
            second = [t for r in rs for t in r["second_ms"]]
            answer = [t for r in rs for t in r["answer_ms"]]
            rate = statistics.median(r["server_tok_s"] for r in rs) if rs and "server_tok_s" in rs[0] else float("nan")
            print(f"| {name} | {len(ttft)} | {pct(ttft, 50):.2f} / {pct(ttft, 99):.2f} / {max(ttft):.2f} | "
                  f"{pct(second, 50):.2f} / {pct(second, 99):.2f} | {pct(answer, 50):.2f} / {pct(answer, 99):.2f} | "
                  f"{pct(gaps, 50):.2f} / {pct(gaps, 99):.2f} | {rate:,.0f} |")
    if args.plot:
        from surge.bench.plots import sample_cdfs

        sample_cdfs(_panels({name: record[name] for name in med}), args.plot,
                    f"{shape}, {args.streams} streams, {args.rounds} rounds")
        print(f"plot: {args.plot}")
    print(json.dumps(record), flush=True)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Time to first token of short prompts, alone and joining running streams, under several engine settings in one
run (issue 18): prompt steps replayed as CUDA graphs (`graph_prefill_tokens`, --rows) or launched eagerly (0), and
joining prompts prefilled beside the decode launches in flight (`prefill_beside`, --beside 1) or after them (0).

    PYTHONPATH=src python3 benchmarks/generate_ttft.py --device cuda --shape qwen2-0.5b [--json out.json]
        [--plot out.png]
    python3 benchmarks/generate_ttft.py --plot out.png --from out.json   # the plot of a saved record, no GPU

An eager step launches each of its several hundred kernels from Python; on the GPU machine's host that took
~12 ms for a prefill whose kernels take well under that (benchmarks/generate_prefill_host.py, session 39), so a short
prompt's first token waited for the host, and every decoding stream stalled for as long while a request joined.

* alone: one request at a time (GenerateService.stream, as the HTTP routes call it), prompts of --lengths tokens
  (random ids), 2 output tokens, --repeats each: TTFT from submission to the first token, median and p99; with
  --prefix P each prompt follows the same P-token system prompt, computed once and then taken from the prefix
  cache (a chat turn after a long shared context: the row graphs take such a step only while its rows attend to
  no more keys than a graph_prefill_tokens-token prompt does);
* joining: --background streams decode (128-token prompts, long answers); once all of them stream, a request of
  --join-prompt tokens arrives every --interval ms (--joins of them, 16 output tokens each): their TTFT and whole
  answer, and the background streams' gaps between deliveries while the requests join (ITL p50 / p99 / max).

Settings: every --rows value with every --beside value (beside needs row graphs: with rows 0 only beside 0); the
table's last column is the last setting's p50 over the first's (with the defaults: eager steps over beside).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate import SHAPES, add_engine_args, build, make_service, pct  # noqa: E402


def _params(n: int):
    from surge.runtime.scheduler import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


async def _answer_ms(service, prompt, n_out: int) -> tuple[float, float]:
    """Milliseconds from submission to the first token of one request, and to its last."""
    start, first = time.perf_counter(), None
    async for _ in service.stream(prompt, _params(n_out), deadline=time.monotonic() + 120):
        if first is None:
            first = time.perf_counter()
    return 1e3 * (first - start), 1e3 * (time.perf_counter() - start)


async def _first_token_ms(service, prompt, n_out: int) -> float:
    """Milliseconds from submission to the first token of one request (read to its end)."""
    return (await _answer_ms(service, prompt, n_out))[0]


async def alone(service, vocab: int, lengths: list[int], repeats: int, prefix: int = 0) -> dict:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(2, vocab, (prefix,), generator=g).tolist()
    out = {}
    for n in lengths:
        prompts = [shared + p for p in torch.randint(2, vocab, (repeats + 2, n), generator=g).tolist()]
        for p in prompts[:2]:  # warm: a first call of a shape compiles or picks algorithms
            await _first_token_ms(service, p, 2)
        ttft = [await _first_token_ms(service, p, 2) for p in prompts[2:]]
        out[n] = {"ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": pct(ttft, 99), "ttft_ms": ttft}
    return out


async def joining(service, vocab: int, args) -> dict:
    g = torch.Generator().manual_seed(8)
    bg_prompts = torch.randint(2, vocab, (args.background, 128), generator=g).tolist()
    join_prompts = torch.randint(2, vocab, (args.joins, args.join_prompt), generator=g).tolist()
    started = asyncio.Event()
    streaming = [0]
    window = [float("inf"), float("inf")]  # the joins' first submission, the last join's end
    gaps: list[float] = []

    async def background(p):
        last = None
        try:
            async for _ in service.stream(p, _params(args.output), deadline=time.monotonic() + 600):
                now = time.perf_counter()
                if last is None:
                    streaming[0] += 1
                    if streaming[0] == len(bg_prompts):
                        started.set()
                elif window[0] <= last and now <= window[1]:
                    gaps.append(1e3 * (now - last))
                last = now
        except asyncio.CancelledError:
            pass

    async def join(i, p):
        await asyncio.sleep(i * args.interval / 1e3)
        return await _answer_ms(service, p, 16)

    tasks = [asyncio.create_task(background(p)) for p in bg_prompts]
    await asyncio.wait_for(started.wait(), 120)
    window[0] = time.perf_counter()
    ttft, answer = zip(*await asyncio.gather(*(join(i, p) for i, p in enumerate(join_prompts))))
    window[1] = time.perf_counter()
    done = all(t.done() for t in tasks)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"ttft_p50_ms": statistics.median(ttft), "ttft_p99_ms": pct(ttft, 99), "ttft_ms": list(ttft),
            "answer_p50_ms": statistics.median(answer), "answer_p99_ms": pct(answer, 99), "answer_ms": list(answer),
            "bg_itl_p50_ms": pct(gaps, 50), "bg_itl_p99_ms": pct(gaps, 99), "bg_itl_max_ms": max(gaps, default=0.0),
            "bg_gaps": len(gaps), "bg_finished_early": done}


def measure(path: Path, args, rows: int, beside: bool, priority: int | None, vocab: int) -> dict:
    args.graph_prefill_tokens, args.prefill_beside, args.beside_priority = rows, beside, priority
    engine, service, load_s = make_service(path, args, args.background + args.joins, process=args.engine == "process")
    beside_ms: list[float] = []
    if beside and getattr(engine, "beside_stream", None) is not None:  # the prompt steps' own time beside the launches
        plain = engine.prefill_beside

        def timed(scheduled):
            t = time.perf_counter()
            out = plain(scheduled)
            beside_ms.append(1e3 * (time.perf_counter() - t))
            return out

        engine.prefill_beside = timed

    async def both():
        rec = {"alone": await alone(service, vocab, args.lengths, args.repeats, args.prefix)}
        del beside_ms[:]
        rec["joining"] = await joining(service, vocab, args)
        rec["joining"].update(beside_steps=len(beside_ms), beside_p50_ms=pct(beside_ms, 50),
                              beside_p99_ms=pct(beside_ms, 99))
        await service.close()
        return rec

    rec = asyncio.run(both())
    rec.update(graph_prefill_tokens=rows, prefill_beside=beside, beside_priority=priority, load_s=load_s,
               engine=args.engine, row_buckets=list(engine.row_graphs.buckets)
               if getattr(engine, "row_graphs", None) is not None else [])
    engine = service = None  # noqa: F841 (the GPU memory back before the next engine)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def _label(r: dict) -> str:
    if not r["graph_prefill_tokens"]:
        return "eager steps"
    beside = f", beside (priority {r['beside_priority']})" if r.get("beside_priority") is not None else ", beside"
    return f"graph rows ({r['graph_prefill_tokens']})" + (beside if r.get("prefill_beside") else "")


def table(records: list[dict], prefix: int = 0) -> str:
    """A column a setting (TTFT p50 / p99 ms; the streams' ITL), the last column the last setting's over the first's."""
    after = f" after a cached {prefix}-token prefix" if prefix else ""
    first, last = records[0], records[-1]
    lines = ["| | " + " | ".join(f"{_label(r)}: p50 / p99 ms" for r in records) +
             f" | {_label(last)} / {_label(first)}, p50 |", "| --- |" + " ---: |" * (len(records) + 1)]

    def row(name, get, ratio):
        cells = " | ".join(get(r) for r in records)
        lines.append(f"| {name} | {cells} | {ratio:.2f}x |")

    for n in first["alone"]:
        row(f"alone, {n}-token prompt{after}", lambda r: f"{r['alone'][n]['ttft_p50_ms']:.2f} / "
            f"{r['alone'][n]['ttft_p99_ms']:.2f}", last["alone"][n]["ttft_p50_ms"] / first["alone"][n]["ttft_p50_ms"])
    row("joining: the new requests' TTFT", lambda r: f"{r['joining']['ttft_p50_ms']:.2f} / "
        f"{r['joining']['ttft_p99_ms']:.2f}", last["joining"]["ttft_p50_ms"] / first["joining"]["ttft_p50_ms"])
    if all("answer_p50_ms" in r["joining"] for r in records):
        row("joining: the new requests' whole answer (16 tokens)",
            lambda r: f"{r['joining']['answer_p50_ms']:.2f} / {r['joining']['answer_p99_ms']:.2f}",
            last["joining"]["answer_p50_ms"] / first["joining"]["answer_p50_ms"])
    row("joining: the running streams' ITL (max)", lambda r: f"{r['joining']['bg_itl_p50_ms']:.2f} / "
        f"{r['joining']['bg_itl_p99_ms']:.2f} ({r['joining']['bg_itl_max_ms']:.1f})",
        last["joining"]["bg_itl_p99_ms"] / first["joining"]["bg_itl_p99_ms"])
    for r in records:
        j = r["joining"]
        if j.get("beside_steps"):
            lines.append(f"\n{_label(r)}: {j['beside_steps']} prompt steps beside the launches while requests "
                         f"joined, {j['beside_p50_ms']:.2f} / {j['beside_p99_ms']:.2f} ms each (p50 / p99, "
                         f"host wall time of the step)")
    return "\n".join(lines)


def plot(record: dict, out: Path) -> None:
    """TTFT by prompt length (alone), and the joining requests' TTFT distribution, both forms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in record["records"]:
        label = _label(r)
        lengths = [int(n) for n in r["alone"]]
        ax1.plot(lengths, [v["ttft_p50_ms"] for v in r["alone"].values()], "o-", label=label)
        ttft = sorted(r["joining"]["ttft_ms"])
        ax2.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], drawstyle="steps-post", label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("prompt tokens (one request at a time)")
    ax1.set_ylabel("time to first token, median (ms)")
    ax1.legend(fontsize=8)
    ax2.set_xlabel(f"time to first token (ms), requests joining {record['background']} decoding streams")
    ax2.set_ylabel("fraction of requests")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{record['shape']} on {record['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap)
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES))
    ap.add_argument("--lengths", type=int, nargs="+", default=[8, 32, 128, 256, 512])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prefix", type=int, default=0, help="a shared system prompt of this many tokens before each "
                    "prompt measured alone (prefix caching on)")
    ap.add_argument("--background", type=int, default=48)
    ap.add_argument("--joins", type=int, default=24)
    ap.add_argument("--join-prompt", type=int, default=32)
    ap.add_argument("--interval", type=float, default=25.0, help="ms between joining requests")
    ap.add_argument("--rows", type=int, nargs="+", default=[512, 0], help="graph_prefill_tokens settings to compare")
    ap.add_argument("--beside", type=int, nargs="+", default=[1, 0], choices=[0, 1],
                    help="prefill_beside settings to compare (with each --rows value but 0)")
    ap.add_argument("--beside-priority", type=int, nargs="+", default=None,
                    help="the beside stream's priorities to compare (lower: higher; default: the engine's)")
    ap.add_argument("--engine", choices=["thread", "process"], default="thread", help="the engine loop in a thread "
                    "of this process, or in a process of its own as `surge serve` runs it on a GPU")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--from", dest="src", type=Path, help="plot this saved --json record instead of measuring")
    args = ap.parse_args(argv)
    if args.src:
        record = json.loads(args.src.read_text())
    else:
        shape = args.shape or ("qwen2-0.5b" if args.device.startswith("cuda") else "gpt2-tiny")
        args.prompt, args.output = args.prefix + max(args.lengths + [128, args.join_prompt]), 1024
        args.prefix_caching = args.prefix > 0
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        with tempfile.TemporaryDirectory() as tmp:
            path = build(shape, Path(tmp) / shape, args.device)
            vocab = SHAPES[shape][1].get("vocab_size", 1000)
            settings = [(rows, bool(b), pr if b else None) for rows in args.rows for b in (args.beside if rows else [0])
                        for pr in (args.beside_priority or [None])]
            records = [measure(path, args, *setting, vocab) for setting in dict.fromkeys(settings)]
        record = {"shape": shape, "device": device, "background": args.background, "prefix": args.prefix,
                  "records": records,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        print(json.dumps({k: v for k, v in record.items() if k != "records"}))
        print(table(records, args.prefix))
        if args.json:
            args.json.write_text(json.dumps(record, indent=1))
    if args.plot:
        plot(record, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

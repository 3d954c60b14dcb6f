"""CPU per request of `surge serve --workers` front ends: old code against new, alternating.

The front ends' CPU is what limits `--workers` on the H200 host (docs/benchmarks/serving_core.md,
"Session 2"); it does not depend on the engine, so this runs a CPU engine (torch, a random-weight
MiniLM-shaped model with few layers: the same tokenizer, hidden size 384, so the same JSON) and
measures the front-end processes' CPU seconds (utime + stime, psutil) over a fixed number of
requests, which is robust to a loaded machine, unlike req/s. Each round starts the server of each
tree in turn (old, new, old, new ...), sends warm-up requests, then REQUESTS requests from CLIENTS
concurrent keep-alive clients (one real sentence per request, OpenAI /v1/embeddings or /embed, or
KServe ModelInfer on the gRPC port: `--path ModelInfer`), and reads the front ends' CPU before and after.
Prints the median of the rounds as a table.

    python benchmarks/frontend_cpu.py --old /work/main/src --new src --rounds 3 --requests 4000 --clients 64

The load generator is one aiohttp process (uvloop; grpc.aio over one channel for ModelInfer); its CPU is not
counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

ST_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "modules.json",
            "sentence_bert_config.json", "config_sentence_transformers.json")


def make_model(out: Path, layers: int) -> Path:
    """A random-weight (seed 0) MiniLM-shaped model with `layers` layers and the bundled tokenizer."""
    from surge.models import bundled_model_dir

    dst = out / f"minilm-l{layers}"
    if (dst / "model.safetensors").is_file():
        return dst
    import torch
    from transformers import BertConfig, BertModel

    files = Path(bundled_model_dir())
    base = json.loads((files / "config.json").read_text())
    base = {k: v for k, v in base.items() if k not in ("architectures", "transformers_version")}
    base["num_hidden_layers"] = layers
    dst.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    BertModel(BertConfig(**base)).eval().save_pretrained(dst, safe_serialization=True)
    for name in ST_FILES:
        if (files / name).is_file():
            shutil.copy(files / name, dst / name)
    shutil.copytree(files / "1_Pooling", dst / "1_Pooling", dirs_exist_ok=True)
    return dst


def _fronts(pid: int) -> list:
    import psutil

    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        if "surge.cli.workers" in cmd and cmd[cmd.index("surge.cli.workers") + 1] == "front":
            out.append(p)
    return out


def _cpu(procs: list) -> float:
    t = 0.0
    for p in procs:
        c = p.cpu_times()
        t += c.user + c.system
    return t


async def _load_grpc(target: str, n: int, clients: int, rng: random.Random, sentences: list[str]) -> dict:
    import grpc

    from surge.server.grpc import grpc_service_pb2 as pb
    from surge.server.grpc import grpc_service_pb2_grpc as pb_grpc

    def request(text: str) -> pb.ModelInferRequest:
        req = pb.ModelInferRequest(model_name="m")
        req.inputs.add(name="text", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text.encode())
        return req

    it = iter([request(rng.choice(sentences)) for _ in range(n)])
    bad: dict[str, int] = {}
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def client():
            for req in it:
                try:
                    await stub.ModelInfer(req, timeout=120)
                except grpc.aio.AioRpcError as exc:
                    bad[exc.code().name] = bad.get(exc.code().name, 0) + 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "errors": bad}


async def _load(url: str, path: str, n: int, clients: int, seed: int) -> dict:
    import aiohttp
    import orjson

    from surge.data import load_sentences

    sentences = load_sentences()
    rng = random.Random(seed)
    if path == "ModelInfer":  # `url`: the gRPC target
        return await _load_grpc(url, n, clients, rng, sentences)
    bodies = [orjson.dumps({"input": rng.choice(sentences), "model": "m"} if path == "/v1/embeddings"
                           else {"inputs": rng.choice(sentences)}) for _ in range(n)]
    it = iter(bodies)
    bad: dict[int, int] = {}

    async def client(s):
        for body in it:
            async with s.post(url + path, data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
                if r.status != 200:
                    bad[r.status] = bad.get(r.status, 0) + 1

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "errors": bad}


def _run_load(*args) -> dict:
    try:
        import uvloop

        return uvloop.run(_load(*args))
    except ImportError:
        return asyncio.run(_load(*args))


# One front end (serve_workers with workers=1: the supervisor, one engine process, one front end),
# so that every request goes to the process measured: with two, the kernel spreads connections
# unevenly and a busier front end spends less CPU per request (more requests per loop pass).
LAUNCH = ("import json, sys; from surge.config import ServerConfig; from surge.cli.workers import serve_workers; "
          "sys.exit(serve_workers(ServerConfig.model_validate(json.loads(sys.argv[1])), int(sys.argv[2])))")


def measure(tree: str, model: Path, args, seed: int) -> dict:
    from surge.bench.servers import ServerProc, free_port

    port = free_port()
    grpc_port = free_port() if args.path == "ModelInfer" else 0
    env = {"PYTHONPATH": os.pathsep.join([str(Path(tree).resolve()), str(ROOT)]), "OMP_NUM_THREADS": "1",
           **dict(kv.split("=", 1) for kv in args.env)}
    cfg = {"model_dir": str(model), "model_name": "m", "port": port, "grpc_port": grpc_port, "log_level": "warning",
           "engine": {"engine": "torch", "device": "cpu"}, "cache": {"max_bytes": args.cache_bytes},
           "engine_processes": 1}
    argv = [sys.executable, "-c", LAUNCH, json.dumps(cfg), str(args.workers)]
    with ServerProc("surge", argv, port, env=env, cwd=ROOT) as srv:
        fronts = _fronts(srv.proc.pid)
        assert len(fronts) == args.workers, srv.output()
        target = f"127.0.0.1:{grpc_port}" if grpc_port else srv.url
        _run_load(target, args.path, args.warmup, args.clients, seed + 1)
        c0 = _cpu(fronts)
        out = _run_load(target, args.path, args.requests, args.clients, seed)
        c1 = _cpu(fronts)
    return {"us_per_req": (c1 - c0) / args.requests * 1e6, "rps": args.requests / out["wall_s"],
            "errors": out["errors"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default="/work/main/src", help="the old tree's src directory")
    ap.add_argument("--new", default=str(ROOT / "src"), help="the new tree's src directory")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1, help="front-end processes")
    ap.add_argument("--layers", type=int, default=1, help="layers of the random MiniLM-shaped model")
    ap.add_argument("--path", default="/v1/embeddings", choices=("/v1/embeddings", "/embed", "ModelInfer"))
    ap.add_argument("--cache-bytes", type=int, default=0)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server (both trees)")
    ap.add_argument("--models", default=str(Path(os.environ.get("TMPDIR", "/tmp")) / "surge-frontend-cpu"))
    ap.add_argument("--json", default=None, help="write the per-round numbers here")
    args = ap.parse_args()
    model = make_model(Path(args.models), args.layers)
    trees = {"old": args.old, "new": args.new}
    rows: dict[str, list[dict]] = {k: [] for k in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            m = measure(tree, model, args, seed=r)
            rows[name].append(m)
            print(f"round {r} {name}: {m['us_per_req']:.1f} us/request, {m['rps']:.0f} req/s, errors {m['errors']}",
                  file=sys.stderr, flush=True)
    print(f"\n{args.path}, {args.requests} requests x {args.rounds} rounds, {args.clients} clients, "
          f"{args.workers} front end(s), cache-bytes {args.cache_bytes}, load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| code | front-end CPU us/request (median) | min | rounds | req/s (median; machine-dependent) |")
    print("|---|---:|---:|---|---:|")
    med = {}
    for name in trees:
        us = [m["us_per_req"] for m in rows[name]]
        med[name] = statistics.median(us)
        print(f"| {name} ({trees[name]}) | {med[name]:.1f} | {min(us):.1f} | {', '.join(f'{u:.0f}' for u in us)} | "
              f"{statistics.median(m['rps'] for m in rows[name]):.0f} |")
    print(f"\nnew / old: {med['new'] / med['old']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

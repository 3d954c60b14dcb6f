"""surge on a GPU against the hand-written FastAPI + sentence-transformers server and Infinity.

One run: random-weight MiniLM-L6 and BERT-base (the bundled tokenizer, seed 0),
one real sentence per request (OpenAI /v1/embeddings), closed loop at each
client count, a load generator of several processes (keep-alive connections through
`surge.bench.rawhttp`, ~9x less CPU a request than aiohttp: benchmarks/loadgen_clients.py;
`--client aiohttp` for the older one) whose CPU use is reported, surge's SM utilization read from its /metrics. Servers
run one at a time on the same GPU; each is started, swept, stopped.

    PYTHONPATH=src python benchmarks/gpu_serving.py --files DIR_WITH_TOKENIZER --out OUT \
        --models minilm,bert-base --clients 1,16,64,256 --servers surge,baseline,infinity

`--files`: a model directory without weights (config.json, tokenizer, sentence-
transformers files: the bundled MiniLM's). `--surge NAME=FLAGS` adds a surge
variant (repeatable), e.g. --surge "surge-w4=--workers 4"; `surge-repo` serves the model
from a repository of one entry under --workers (the default front-end count). Infinity runs when
`import infinity_emb` works with INFINITY_PATH prepended to PYTHONPATH (its wheels,
and benchmarks/baselines/infinity_shim for transformers 5).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

ST_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json", "modules.json",
            "sentence_bert_config.json", "config_sentence_transformers.json")


def make_model(kind: str, files: Path, out: Path) -> Path:
    """A random-weight BERT-family model (seed 0) with the bundled tokenizer and pooling files."""
    import torch
    from transformers import BertConfig, BertModel

    dst = out / kind
    if (dst / "model.safetensors").is_file():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    base = json.loads((files / "config.json").read_text())
    cfg = BertConfig(**{k: v for k, v in base.items() if k not in ("architectures", "transformers_version")})
    if kind == "bert-base":
        cfg = BertConfig(vocab_size=cfg.vocab_size)  # hidden 768, 12 layers, 12 heads, FFN 3072
    torch.manual_seed(0)
    BertModel(cfg).eval().save_pretrained(dst, safe_serialization=True)
    for name in ST_FILES:
        if (files / name).is_file():
            shutil.copy(files / name, dst / name)
    if (files / "1_Pooling").is_dir():
        shutil.copytree(files / "1_Pooling", dst / "1_Pooling", dirs_exist_ok=True)
    return dst


# ---------------------------------------------------------------- load generator (processes)

STAGES = ("x-surge-tokenize-ms", "x-surge-queue-ms", "x-surge-inference-ms", "x-surge-postprocess-ms")

def _load_proc(url: str, body_model: str, clients: int, warmup: float, duration: float, seed: int,
               start_at: float, q, client_kind: str = "raw") -> None:
    import asyncio
    import random
    from urllib.parse import urlsplit

    import orjson

    from surge.bench.rawhttp import RawConnection

    from surge.data import load_sentences

    sentences = load_sentences()
    rng = random.Random(seed)
    lat: list[float] = []
    errors: dict[str, int] = {}
    stages: dict[str, float] = {}

    async def client(send, t_measure, t_end):
        """Closed loop: `send(body) -> (status, stage headers)`, one request at a time."""
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                return
            body = orjson.dumps({"input": rng.choice(sentences), "model": body_model})
            try:
                status, headers = await send(body)
                kind = None if status == 200 else str(status)
            except Exception as exc:  # noqa: BLE001
                kind, headers = type(exc).__name__, {}
            t1 = time.perf_counter()
            if t0 < t_measure:
                continue
            if kind is not None:
                errors[kind] = errors.get(kind, 0) + 1
                continue
            lat.append(t1 - t0)
            for h, v in headers.items():  # surge's own stage timings (ms), where the server sends them
                stages[h] = stages.get(h, 0.0) + float(v)
                stages[h + "#"] = stages.get(h + "#", 0) + 1

    def aiohttp_send(session):
        async def send(body):
            async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
                await r.read()
                return r.status, {h: r.headers[h] for h in STAGES if h in r.headers}
        return send

    def raw_send(conn, path):
        async def send(body):
            try:
                r = await conn.request(path, body)
            except Exception:
                conn.close()  # the next request opens a new connection
                raise
            return r.status, r.headers
        return send

    async def main():
        delay = start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        t_measure = time.perf_counter() + warmup
        if client_kind == "raw":
            u = urlsplit(url)
            conns = [RawConnection(u.hostname, u.port, want=STAGES) for _ in range(clients)]
            try:
                await asyncio.gather(*(client(raw_send(c, u.path), t_measure, t_measure + duration) for c in conns))
            finally:
                for c in conns:
                    c.close()
            return
        import aiohttp  # only for --client aiohttp: the device machine may not have it

        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=60)) as s:
            await asyncio.gather(*(client(aiohttp_send(s), t_measure, t_measure + duration) for _ in range(clients)))

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    cpu = os.times()
    q.put({"lat": lat, "errors": errors, "cpu_s": cpu.user + cpu.system, "stages": stages})


def run_level(url: str, model: str, clients: int, procs: int, warmup: float, duration: float, seed: int,
              client_kind: str = "raw") -> dict:
    import numpy as np

    procs = max(1, min(procs, clients))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    start_at = time.time() + 0.5
    per = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    ps = [ctx.Process(target=_load_proc, args=(url, model, n, warmup, duration, seed * 1000 + i, start_at, q,
                                                       client_kind))
          for i, n in enumerate(per)]
    for p in ps:
        p.start()
    outs = [q.get(timeout=warmup + duration + 120) for _ in ps]
    for p in ps:
        p.join()
    lat = np.array([x for o in outs for x in o["lat"]]) * 1000
    errors: dict[str, int] = {}
    for o in outs:
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
    cpu = sum(o["cpu_s"] for o in outs)
    st: dict[str, float] = {}
    for o in outs:
        for k, v in o["stages"].items():
            st[k] = st.get(k, 0) + v
    stage_ms = {k.removeprefix("x-surge-").removesuffix("-ms"): round(st[k] / st[k + "#"], 4)
                for k in STAGES if st.get(k + "#")}
    return {"clients": clients, "requests": int(lat.size), "rps": lat.size / duration,
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
            "p99_ms": float(np.percentile(lat, 99)) if lat.size else None,
            "errors": errors, "loadgen_cores": cpu / (warmup + duration + 0.5), "loadgen_procs": procs,
            "stage_ms": stage_ms, "client": client_kind}


def _roles(pid: int) -> dict[str, list]:
    """surge's processes by role (engine, front, main) under the server's pid."""
    import psutil

    out: dict[str, list] = {}
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            cmd = p.cmdline()
        except psutil.Error:
            continue
        role = cmd[cmd.index("surge.cli.workers") + 1] if "surge.cli.workers" in cmd else "main"
        out.setdefault(role, []).append(p)
    return out


def _cpu(roles: dict[str, list]) -> dict[str, float]:
    out = {}
    for role, ps in roles.items():
        t = 0.0
        for p in ps:
            try:
                c = p.cpu_times()
                t += c.user + c.system
            except Exception:  # noqa: BLE001 - a process that went away
                pass
        out[role] = t
    return out


def _spy(roles: dict[str, list], seconds: float, out: Path, tag: str) -> list:
    """py-spy (if installed) on the engine process(es) and the first front end, raw stacks to OUT."""
    import subprocess

    spy = shutil.which("py-spy")
    if spy is None:
        return []
    targets = [("engine", p) for p in roles.get("engine", [])[:2]] + [("front", p) for p in roles.get("front", [])[:1]]
    if not targets:
        targets = [("main", p) for p in roles.get("main", [])[:1]]
    return [subprocess.Popen([spy, "record", "-p", str(p.pid), "-d", str(max(1, int(seconds))), "-r", "97",
                              "-f", "raw", "--nonblocking", "-o", str(out / f"prof_{tag}_{role}{i}.txt")],
                             stdout=subprocess.DEVNULL, stderr=open(out / f"prof_{tag}_{role}{i}.err", "w"))
            for i, (role, p) in enumerate(targets)]


def scrape(url: str, names: tuple[str, ...]) -> dict:
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except Exception:  # noqa: BLE001
        return {}
    out = {}
    for line in text.splitlines():
        for n in names:
            if line.startswith(n) and not line.startswith("#"):
                m = re.match(r"(\S+?)(\{.*\})?\s+(\S+)$", line)
                if m:
                    out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


# ---------------------------------------------------------------- servers

def servers(args, model_dir: Path, port: int) -> dict:
    py = sys.executable
    out = {}
    gpu = args.device.startswith("cuda")
    surge = [py, "-m", "surge.cli.main", "serve", str(model_dir), "--engine", "torch", "--device", args.device,
             "--precision", "fp16" if gpu else "fp32", "--cache-bytes", "0", "--grpc-port", "0", "--port", str(port),
             "--log-level", "warning", "--model-name", "m"]
    out["surge"] = (surge, "/ready", "/v1/embeddings", {})
    for spec in args.surge:
        name, _, flags = spec.partition("=")
        toks = shlex.split(flags)  # KEY=VALUE tokens (upper-case keys) are environment variables
        env = dict(t.split("=", 1) for t in toks if re.match(r"^[A-Z][A-Z0-9_]*=", t))
        out[name] = (surge + [t for t in toks if not re.match(r"^[A-Z][A-Z0-9_]*=", t)], "/ready",
                     "/v1/embeddings", env)
    # The same model as a repository of one entry under --workers (cli/workers_repo.py): the front-end
    # count that `surge serve MODEL` picks by default, given explicitly (repositories default to one).
    repo = Path(args.out) / "repo" / model_dir.name
    (repo / "m" / "1").mkdir(parents=True, exist_ok=True)
    (repo / "m" / "1" / "model.yaml").write_text(
        f"source: {model_dir}\nengine: {{engine: torch, device: {args.device}, precision: {'fp16' if gpu else 'fp32'}}}\n")
    fronts = str(min(12, (os.cpu_count() or 1) * 3 // 4) if gpu else 2)
    out["surge-repo"] = ([py, "-m", "surge.cli.main", "serve", "--model-repository", str(repo), "--workers", fronts,
                          "--cache-bytes", "0", "--grpc-port", "0", "--port", str(port), "--log-level", "warning"],
                         "/ready", "/v1/embeddings", {})
    out["baseline"] = ([py, str(HERE / "baselines" / "fastapi_st.py"), "--port", str(port), "--model-dir",
                        str(model_dir), "--device", args.device], "/ready", "/v1/embeddings", {})
    inf_path = os.environ.get("INFINITY_PATH")
    if inf_path:
        env = {"PYTHONPATH": os.pathsep.join([str(HERE / "baselines" / "infinity_shim"), inf_path,
                                              os.environ.get("PYTHONPATH", "")])}
        out["infinity"] = ([py, "-c", "from infinity_emb.cli import cli; cli()", "v2", "--model-id", str(model_dir),
                            "--served-model-name", "m", "--port", str(port), "--engine", "torch", "--device",
                            args.device, "--dtype", "float16" if gpu else "float32", "--batch-size", "64"], "/health", "/embeddings", env)
    return out


def write(out: Path, results: list[dict]) -> None:
    """gpu_serving.json and gpu_serving.md (the table), rewritten after every server."""
    (out / "gpu_serving.json").write_text(json.dumps(results, indent=1))
    lines = ["| model | server | clients | req/s | p50 ms | p99 ms | errors | load-gen cores | server cores | SM util | builds after ready |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['server']} | - | skipped: {r['skipped'][:80]} | | | | | | | |")
            continue
        f = lambda v, d=1: "-" if v is None else f"{v:,.{d}f}"  # noqa: E731
        lines.append(f"| {r['model']} | {r['server']} | {r['clients']} | {r['rps']:,.0f} | {f(r['p50_ms'], 2)} | "
                     f"{f(r['p99_ms'], 2)} | {sum(r['errors'].values())} | {r['loadgen_cores']:.2f} | "
                     f"{' '.join(f'{k} {v:.2f}' for k, v in sorted(r.get('server_cores', {}).items()))} | "
                     f"{f(r.get('sm_util'), 2)} | {f(r.get('builds_serving'), 0)} |")
    (out / "gpu_serving.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--models", default="minilm,bert-base")
    p.add_argument("--clients", default="1,16,64,256")
    p.add_argument("--servers", default="surge,baseline,infinity")
    p.add_argument("--surge", action="append", default=[], help="NAME=FLAGS: another surge variant")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--load-procs", type=int, default=8)
    p.add_argument("--client", default="raw", choices=("raw", "aiohttp"),
                   help="the load generator's HTTP client: raw (surge.bench.rawhttp) or aiohttp (~9x the CPU "
                        "a request, benchmarks/loadgen_clients.py: it shares the host's cores with the server)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of the script")
    p.add_argument("--models-dir", type=Path, default=None, help="where the random-weight models go (default OUT/models)")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting servers after this many seconds")
    p.add_argument("--profile", default="", help="client counts at which py-spy samples surge's engine "
                   "process(es) and a front end (raw stacks to OUT/prof_*.txt)")
    args = p.parse_args()
    args.profile = {int(x) for x in args.profile.split(",") if x}

    from surge.bench.servers import ServerProc, free_port

    t_start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for kind in args.models.split(","):
        model_dir = make_model(kind, args.files, args.models_dir or args.out / "models")
        for name in args.servers.split(","):
            if time.monotonic() - t_start > args.budget_s:
                print(f"budget spent: skipping {name} on {kind}", flush=True)
                continue
            port = free_port()
            table = servers(args, model_dir, port)
            if name not in table:
                print(f"{name}: not available here (skipped)", flush=True)
                results.append({"model": kind, "server": name, "skipped": "not available"})
                continue
            argv, ready, path, env = table[name]
            srv = ServerProc(f"{name}-{kind}", argv, port, ready_path=ready, ready_timeout_s=240, env=env)
            t0 = time.monotonic()
            try:
                srv.start()
            except Exception as exc:  # noqa: BLE001
                print(f"{name} on {kind} failed to start: {exc}"[:3000], flush=True)
                results.append({"model": kind, "server": name, "skipped": f"start failed: {str(exc)[-800:]}"})
                continue
            startup = time.monotonic() - t0
            print(f"{name} on {kind}: ready in {startup:.1f} s", flush=True)
            try:
                for c in [int(x) for x in args.clients.split(",")]:
                    if name.startswith("surge"):
                        scrape(srv.url, ("surge_gpu",))  # opens the NVML sampling window
                    roles = _roles(srv.proc.pid)
                    cpu0 = _cpu(roles)
                    spies = []
                    if c in args.profile and name.startswith("surge"):
                        import threading

                        timer = threading.Timer(1.0 + args.warmup, lambda: spies.extend(
                            _spy(roles, args.duration - 0.5, args.out, f"{name}_{kind}_{c}")))
                        timer.start()
                    t_lvl = time.monotonic()
                    r = run_level(srv.url + path, "m", c, args.load_procs, args.warmup, args.duration, c,
                                  args.client)
                    span = time.monotonic() - t_lvl
                    cpu1 = _cpu(roles)
                    r["server_cores"] = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / span, 2) for k in cpu1}
                    for sp in spies:
                        try:
                            sp.wait(timeout=30)
                        except Exception:  # noqa: BLE001
                            sp.kill()
                    if name.startswith("surge"):
                        m = scrape(srv.url, ("surge_gpu_sm_utilization", "surge_gpu_utilization",
                                             "surge_engine_graph_builds", "surge_tokenize_latency_seconds_sum",
                                             "surge_tokenize_latency_seconds_count"))
                        r["sm_util"] = next((v for k, v in m.items() if k.startswith("surge_gpu_sm_util")), None)
                        r["gpu_util"] = next((v for k, v in m.items() if k.startswith("surge_gpu_utilization")), None)
                        served = [v for k, v in m.items() if 'phase="serving"' in k]
                        r["builds_serving"] = sum(served) if served else None  # None: engine in another process
                    r.update(model=kind, server=name, startup_s=startup)
                    results.append(r)
                    print(json.dumps(r), flush=True)
            finally:
                srv.stop()
                write(args.out, results)
                tail = srv.output(1500)
                if "Traceback" in tail:
                    print(f"--- {name} log tail ---\n{tail}", flush=True)
    write(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())

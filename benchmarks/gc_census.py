"""What a full garbage collection costs in a running `surge serve` process, and why: its tracked objects.

    PYTHONPATH=src python3 benchmarks/gc_census.py [--json OUT]

Starts `surge serve` of the bundled MiniLM and of a tiny random decoder (tests/decoder_models.py; its engine
loop in a process of its own), each with benchmarks/gc_trace/sitecustomize.py on its path, once ready sends
SIGUSR2 to every process of the server (front end, engine process), and reports each one's census: the tracked
objects frozen by the start-up (runtime/gc_settle.py) and not, a full collection's time as the process is
(frozen) and with everything unfrozen (as with --no-gc-freeze), and the tracked objects by top-level package.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))


def census(name: str, cmd: list[str], port: int, trace: Path) -> list[dict]:
    from surge.bench.servers import ServerProc

    env = {"PYTHONPATH": f"{ROOT / 'benchmarks' / 'gc_trace'}:{ROOT / 'src'}", "SURGE_GC_TRACE": str(trace)}
    with ServerProc(name, cmd, port, cwd=ROOT, env=env) as srv:
        time.sleep(2)
        procs = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
        procs = [p for p in procs if (trace / f"{p.pid}.jsonl").exists()]  # Python processes of this server
        for p in procs:
            os.kill(p.pid, signal.SIGUSR2)
        end = time.monotonic() + 60
        out = []
        for p in procs:
            role = "front end" if p.pid == srv.proc.pid else "engine process"
            while time.monotonic() < end:
                found = [json.loads(line)["census"] for line in (trace / f"{p.pid}.jsonl").read_text().splitlines()
                         if '"census"' in line]
                if found:
                    out.append({"server": name, "process": role, **found[-1]})
                    break
                time.sleep(0.2)
        return out


def main(argv=None) -> int:
    from surge.bench.servers import free_port
    from tests.decoder_models import build_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model("qwen2", Path(tmp) / "m", seed=5)
        base = [sys.executable, "-m", "surge.cli.main", "serve", "--threads", "1"]
        for name, extra in (("bundled MiniLM", []), ("tiny qwen2 decoder", [str(model), "--model-name", "m"])):
            port = free_port()
            rows += census(name, [*base, *extra, "--port", str(port), "--grpc-port", str(free_port())], port,
                           Path(tmp) / name.replace(" ", "_"))
    print("| server | process | frozen | not frozen | full collection ms, frozen | full collection ms, unfrozen "
          "| tracked objects by package (top 8) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        pkgs = ", ".join(f"{k} {v:,}" for k, v in r["by_package"][:8])
        print(f"| {r['server']} | {r['process']} | {r['frozen']:,} | {r['unfrozen_before_collect']:,} | "
              f"{r['full_ms_as_it_was']:.2f} | {r['full_ms_unfrozen']:.1f} | {pkgs} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""CPU that every process and every HTTP client pays before doing work, against its baseline in the same run.

1. `import onnx` (what `surge serve`, its engine workers and the CLI import) with the installed ml_dtypes
   against another ml_dtypes unpacked in `--baseline-ml-dtypes DIR` (e.g. 0.7.0: `pip download ml_dtypes==0.7.0
   --no-deps -d w && unzip -q w/*.whl -d DIR`), run alternately in fresh interpreters.
2. A new `httpx.Client()` (loads the CA bundle) against one given a TLS context made once.

    python3 benchmarks/startup_cpu.py --baseline-ml-dtypes /tmp/mld070 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import resource
import ssl
import statistics
import subprocess
import sys
import time


def child_cpu(code: str, extra_path: str | None) -> tuple[float, str]:
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = extra_path + os.pathsep + env.get("PYTHONPATH", "")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out.strip()


def client_ms(n: int, **kw) -> float:
    import httpx

    t = time.process_time()
    for _ in range(n):
        httpx.Client(**kw).close()
    return (time.process_time() - t) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-ml-dtypes", help="a directory holding another ml_dtypes package")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    code = "import onnx, ml_dtypes; print(ml_dtypes.__version__)"
    sides = {"installed": None} | ({"baseline": args.baseline_ml_dtypes} if args.baseline_ml_dtypes else {})
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    version = {}
    for _ in range(args.rounds):  # alternating, so a busy moment hits both sides
        for name, path in sides.items():
            t, version[name] = child_cpu(code, path)
            cpu[name].append(t)
    print(f"{'import onnx (fresh interpreter)':34} {'ml_dtypes':>9} {'CPU s median':>13} {'min':>6} {'max':>6}")
    for name in sides:
        xs = cpu[name]
        print(f"{name:34} {version[name]:>9} {statistics.median(xs):13.3f} {min(xs):6.3f} {max(xs):6.3f}")
    if "baseline" in sides:
        print(f"baseline - installed: {statistics.median(cpu['baseline']) - statistics.median(cpu['installed']):.3f} "
              "s of CPU a process")
    ctx = ssl.create_default_context()
    new = [client_ms(10) for _ in range(args.rounds)]
    shared = [client_ms(10, verify=ctx) for _ in range(args.rounds)]
    print(f"httpx.Client(): new TLS context {statistics.median(new):.1f} ms of CPU, "
          f"shared context {statistics.median(shared):.2f} ms (medians of {args.rounds} x 10)")


if __name__ == "__main__":
    main()

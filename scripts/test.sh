#!/usr/bin/env bash
# The whole test suite on a fresh machine with Python and pip: installs surge
# with its test extras (PyTorch CPU build included), a redis-server for the
# shared cache tier's tests when the machine lets us, then runs pytest in two worker processes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = "0" ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
      || echo "warning: could not install redis-server; Redis tests will be skipped" >&2
  else
    echo "warning: redis-server not found; Redis tests will be skipped" >&2
  fi
fi
"$PY" -m pip install -q -e ".[test]"
# Two worker processes (pytest-xdist), each taking whole files so that a module's fixtures are built once: on
# CI's 2 cores the serial run left ~40% of the CPU idle while tests waited on servers and subprocesses. (Tried
# and slower on clean clones here: the CPU-heaviest files in one worker's group, 22:16 against 16:49-19:32; the
# slowest files first, 26:07: two of them at once, each with two threads, ran 25-50% slower.)
# SURGE_TEST_WORKERS=0: one process.
# Threads that spin while waiting take the core the other worker needs: OpenMP's (torch's CPU ops) sleep at a
# barrier instead (a distillation test: 59 s alone, 125 s beside one busy core, 90 s with PASSIVE; 63 s with
# PASSIVE alone), and so do ONNX Runtime's in the optimizer's sessions (the serving engine's never spin).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
export SURGE_ORT_SPINNING="${SURGE_ORT_SPINNING:-0}"
# numpy's and scipy's BLAS (OpenBLAS, pthreads) on one thread per worker: its threads spin as OpenMP's do, beside
# the other worker (GPTQ's rounding 1.39-1.48x a call, benchmarks/gptq_blas_threads.py; the file timings of
# tests/unit/optimize/test_int8_options.py 89 s -> 30 s and test_rowquant.py 79 s -> 54 s under load).
# Torch's BLAS (MKL, OpenMP) and ONNX Runtime's have threads of their own and are not affected.
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
exec "$PY" -m pytest -q -n "${SURGE_TEST_WORKERS:-2}" --dist loadfile "$@"

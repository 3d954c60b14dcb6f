#!/usr/bin/env bash
# The whole test suite on a fresh machine with Python and pip: installs surge
# with its test extras (PyTorch CPU build included), a redis-server for the
# shared cache tier's tests when the machine lets us, then runs pytest.
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
exec "$PY" -m pytest -q "$@"

"""benchmarks/trace_lone_request.py: its traced copy imports and records; its report pairs events of
several processes in time order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trace_lone_request as T  # noqa: E402


def test_the_traced_copy_imports_and_writes_its_events(tmp_path):
    T.make(tmp_path / "copy")
    code = ("import surge.runtime.ipc, surge.runtime.batcher, surge.runtime.service, surge.runtime.worker, "
            "surge.server.state, surge.server.http.hotpath, surge.server.http.direct, surge.engines.torch_gpu\n"
            "from surge._trace import ev\n"
            "for i in range(6000): ev('x')\n")
    env = {"PYTHONPATH": str(tmp_path / "copy" / "src"), "SURGE_TRACE_DIR": str(tmp_path / "ev"), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    files = list((tmp_path / "ev").glob("ev.*"))
    assert len(files) == 1 and len(files[0].read_text().splitlines()) == 6000
    assert "_ev('eng_launch0')" in (tmp_path / "copy" / "src" / "surge" / "runtime" / "batcher.py").read_text()
    assert "_ev('fe_http')" in (tmp_path / "copy" / "src" / "surge" / "server" / "http" / "direct.py").read_text()


def test_the_report_takes_medians_of_consecutive_events_across_processes(tmp_path, capsys):
    # Two processes, ten requests: front end (a) 5 us to "mid", engine (b) 7 us more to "end".
    a, b = [], []
    for k in range(10):
        t0 = 1_000_000 * k
        a.append(f"fe_http {t0}")
        b.append(f"mid {t0 + 5_000}")
        a.append(f"end {t0 + 12_000 + (k % 2) * 2_000}")
    (tmp_path / "ev.1").write_text("\n".join(a) + "\n")
    (tmp_path / "ev.2").write_text("\n".join(b) + "\n")
    T.report(str(tmp_path))
    out = capsys.readouterr().out
    assert "requests 9" in out  # the first tenth is warm-up
    assert "fe_http -> mid" in out and "5.0 us" in out
    line = next(x for x in out.splitlines() if x.startswith("mid -> end"))
    assert "p50      9.0 us" in line  # requests 1-9: five of 9 us (odd k), four of 7 us

"""Prepare the task heads for a GPU machine without the bundled-model package.

Writes OUT/heads/<name>/{config.json, head.safetensors} for the test heads of
tests/task_models.py (the trained intent classifier and slot tagger, the seeded
random classifier and cross-encoder): a few hundred KiB. On the GPU machine,
surge.models.build.assemble_checkpoint joins each with the backbone copy that
benchmarks/gpu_prepare.py writes (OUT/minilm).

    PYTHONPATH=src:. python3 benchmarks/tasks_prepare.py OUT
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from surge.engines.heads import save_head_tensors

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.task_models import task_models_dir  # noqa: E402


def main(out: Path) -> None:
    src = task_models_dir()
    for name in ("intent", "slots", "cls5", "ce", "tok7"):
        d = out / "heads" / name
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / name / "config.json", d / "config.json")
        save_head_tensors(src / name, d)
    print(f"wrote {out / 'heads'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

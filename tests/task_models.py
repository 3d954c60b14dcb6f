"""Task checkpoints for the tests, built once and kept under the test cache directory.

- trained: an intent classifier and a slot tagger, heads trained on the frozen bundled
  MiniLM (surge.models.finetune, data from surge.data.assistant_commands);
- random: seeded random heads on the same backbone (classify with 5 labels,
  multi-label classify, a 1-label cross-encoder reranker, a token tagger with 7 labels).

The directory name carries a hash of the code that builds them, so a change rebuilds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SURGE_TEST_CACHE_DIR", ROOT / ".pytest_cache" / "surge"))
_SOURCES = ("src/surge/models/finetune.py", "src/surge/models/build.py", "src/surge/data/assistant_commands.py",
            "tests/task_models.py")

RANDOM = {
    "cls5": ("classify", ["weather", "music", "timer", "lights", "other"], False),
    "multi": ("classify", ["urgent", "question", "polite", "negative"], True),
    "ce": ("rerank", ["score"], False),
    "tok7": ("token-classify", ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-TIME", "I-TIME"], False),
}


def _key() -> str:
    h = hashlib.sha256()
    for s in _SOURCES:
        h.update((ROOT / s).read_bytes())
    return h.hexdigest()[:12]


def task_models_dir() -> Path:
    """The directory holding intent/, slots/ and the random-head models (built on first use)."""
    from surge.models import bundled_model_dir

    final = CACHE / f"task-models-{_key()}"
    if (final / "DONE").is_file():
        return final
    tmp = final.with_name(final.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    from surge.models.build import random_head_model
    from surge.models.finetune import train_heads

    backbone = bundled_model_dir()
    report = train_heads(backbone, tmp)
    for i, (name, (task, labels, multi)) in enumerate(RANDOM.items()):
        random_head_model(backbone, tmp / name, task, labels, seed=100 + i, multi_label=multi)
    (tmp / "DONE").write_text(json.dumps(report))
    try:
        tmp.rename(final)
    except OSError:  # another test process (pytest-xdist worker) built it first
        if not (final / "DONE").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return final

"""Text shipped with surge (see PROVENANCE.md).

Three corpora:
- `load_sentences()`: 400 prose sentences from the Python documentation
  (the original accuracy sample; other benchmarks and tests use it).
- `load_queries()`: 3,619 assistant-style queries, commands and chat turns
  from PyPI-published voice-assistant and chatbot data, split once (seeded)
  into calibration and held-out parts. `surge optimize` calibrates on the
  first and gates on the second.
- `distill_texts()`: unlabeled training text for `surge distill` (what
  people say to voice assistants and what those say back, from other
  permissively licensed skill packages); never a held-out query.
"""

from __future__ import annotations

import gzip
import json
import re
from functools import lru_cache
from importlib import resources


def normalise(text: str) -> str:
    """How texts are compared for "the same text": lower case, punctuation dropped (apostrophes kept),
    whitespace collapsed. No training text equals a held-out query under it."""
    return " ".join(re.sub(r"[^\w' ]+", " ", text.lower()).split())


def load_sentences() -> list[str]:
    text = resources.files(__name__).joinpath("sentences.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def calibration_sentences() -> list[str]:
    return load_sentences()[:200]


def heldout_sentences() -> list[str]:
    return load_sentences()[200:]


@lru_cache(maxsize=1)
def _query_rows() -> tuple[dict, ...]:
    raw = resources.files(__name__).joinpath("queries.jsonl.gz").read_bytes()
    return tuple(json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip())


def load_queries(split: str | None = None) -> list[str]:
    """The assistant-style corpus; `split`: None (all), "calibration" or "heldout"."""
    if split not in (None, "calibration", "heldout"):
        raise ValueError(f"split must be 'calibration' or 'heldout', not {split!r}")
    return [r["text"] for r in _query_rows() if split is None or r["split"] == split]


def query_sources() -> list[dict]:
    """Every row with its provenance: text, source (wheel:path), split."""
    return [dict(r) for r in _query_rows()]


def calibration_queries() -> list[str]:
    return load_queries("calibration")


def heldout_queries() -> list[str]:
    return load_queries("heldout")


@lru_cache(maxsize=1)
def _distill_rows() -> tuple[dict, ...]:
    raw = resources.files(__name__).joinpath("distill_texts.jsonl.gz").read_bytes()
    return tuple(json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip())


def distill_texts() -> list[str]:
    """Training text for distillation (build_distill_texts.py; PROVENANCE.md): no held-out query is one."""
    return [r["text"] for r in _distill_rows()]


def distill_text_sources() -> list[dict]:
    """Every distillation text with its provenance: text, source (wheel:path)."""
    return [dict(r) for r in _distill_rows()]

"""The assistant intent pipeline: a model repository with two model entries and a
DAG that classifies a query by intent and, for questions, ranks FAQ passages.

    surge serve --model-repository "$(python -c 'import surge.examples.intent as m; print(m.repository_dir())')"
    curl -s localhost:8000/pipelines/assistant -d '{"inputs": {"query": "will it rain tomorrow"}}'
"""

from __future__ import annotations

from pathlib import Path

import yaml


def repository_dir() -> Path:
    """The example's model repository (models/<name>/<version>/model.yaml + assistant/pipeline.yaml)."""
    return Path(__file__).resolve().parent / "repository"


def pipeline_dir() -> Path:
    return repository_dir() / "assistant"


def load_intents() -> dict[str, list[str]]:
    return yaml.safe_load((pipeline_dir() / "intents.yaml").read_text(encoding="utf-8"))["intents"]


def load_heldout() -> list[tuple[str, str]]:
    """(utterance, intent) pairs that are not among the examples: the evaluation set."""
    data = yaml.safe_load((pipeline_dir() / "heldout.yaml").read_text(encoding="utf-8"))["heldout"]
    return [(text, label) for label, texts in data.items() for text in texts]

"""Text shipped with surge (see PROVENANCE.md)."""

from __future__ import annotations

from importlib import resources


def load_sentences() -> list[str]:
    text = resources.files(__name__).joinpath("sentences.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def calibration_sentences() -> list[str]:
    return load_sentences()[:200]


def heldout_sentences() -> list[str]:
    return load_sentences()[200:]

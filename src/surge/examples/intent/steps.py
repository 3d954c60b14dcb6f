"""User functions of the assistant pipeline (named by import path in pipeline.yaml)."""

from __future__ import annotations

# What the assistant does with each intent: questions go to the FAQ search
# branch, chit-chat to a chat model, everything else to a device/app action.
_ACTIONS = {"question": "search", "smalltalk": "chat"}


def route(intent: str, score: float, params: dict) -> dict:
    """Pick the next action; a low-confidence intent asks the user to clarify."""
    if score < float(params.get("min_score", 0.0)):
        return {"action": "clarify"}
    return {"action": _ACTIONS.get(intent, "act")}

"""Writing model repositories for the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

# Small engines so that loads are quick on 2 cores; the export is cached and shared.
FAST = "engine: {threads: 1, warmup_shapes: [[1, 8]]}\n"


def add_version(root: Path, name: str, version: int | str, text: str = FAST) -> Path:
    path = Path(root) / name / str(version) / "model.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole then renamed, so a polling server never reads half a file.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


def set_shared(root: Path, name: str, text: str) -> None:
    path = Path(root) / name / "model.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def entries(client, name: str) -> dict[str, dict]:
    r = client.get(f"/models/{name}")
    assert r.status_code == 200, r.text
    return {e["version"]: e for e in r.json()["versions"]}


def serving(client, name: str) -> list[str]:
    return sorted(v for v, e in entries(client, name).items() if e["serving"])

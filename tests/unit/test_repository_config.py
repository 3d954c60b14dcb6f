"""model.yaml validation and version policies, read from real directories."""

from __future__ import annotations

import pytest

from surge.config import VersionPolicy
from surge.runtime.repository import scan_model


def make(root, name, files: dict[str, str]):
    for rel, text in files.items():
        path = root / name / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


BAD = [
    ("negative threads", {"1/model.yaml": "engine: {threads: -1}\n"}, "1/model.yaml", "engine.threads"),
    ("unknown field", {"1/model.yaml": "sauce: bundled\n"}, "1/model.yaml", "sauce"),
    ("wrong engine", {"1/model.yaml": "engine: {engine: tensorrt}\n"}, "1/model.yaml", "engine.engine"),
    ("bad warmup", {"1/model.yaml": "engine: {warmup_shapes: [[1]]}\n"}, "1/model.yaml", "engine.warmup_shapes"),
    ("missing source dir", {"1/model.yaml": "source: ../nowhere\n"}, "1/model.yaml", "source"),
    ("two policies", {"1/model.yaml": "version_policy: {latest: 2, all: true}\n"}, "1/model.yaml", "version_policy"),
    ("bad yaml", {"1/model.yaml": "engine: [\n"}, "1/model.yaml", "line"),
    ("bad shared file", {"model.yaml": "batching: {max_batch_size: 0}\n", "1/model.yaml": ""}, "enc/model.yaml",
     "batching.max_batch_size"),
    ("no model.yaml", {"1/README": "x"}, "1/model.yaml", "missing"),
]


@pytest.mark.parametrize("name,files,file_part,field", BAD, ids=[b[0] for b in BAD])
def test_invalid_model_yaml_names_file_and_field(tmp_path, name, files, file_part, field):
    make(tmp_path, "enc", files)
    entry = scan_model(tmp_path, "enc")
    error = entry.error or entry.versions["1"].error
    assert error and file_part in error and field in error, error


def test_shared_defaults_merge_and_policy(tmp_path):
    make(tmp_path, "enc", {
        "model.yaml": "engine: {threads: 1, max_seq_len: 64}\nversion_policy: {latest: 2}\n",
        "1/model.yaml": "",
        "2/model.yaml": "engine: {max_seq_len: 32}\n",
        "3/model.yaml": "engine: {threads: 2}\n",
        "notaversion/model.yaml": "",
    })
    entry = scan_model(tmp_path, "enc")
    assert entry.sorted_versions() == ["1", "2", "3"]
    assert entry.versions["2"].config.engine.max_seq_len == 32 and entry.versions["2"].config.engine.threads == 1
    assert entry.versions["3"].config.engine.threads == 2 and entry.versions["3"].config.engine.max_seq_len == 64
    assert entry.desired() == ["2", "3"]
    assert entry.versions["1"].source_dir is None  # bundled


def test_version_policy_select():
    versions = ["1", "2", "5", "10"]
    assert VersionPolicy().select(versions) == ["10"]
    assert VersionPolicy(latest=3).select(versions) == ["2", "5", "10"]
    assert VersionPolicy(specific=["2", "10", "7"]).select(versions) == ["2", "10"]
    assert VersionPolicy(all=True).select(versions) == versions

import json

import pytest

from surge.errors import ConfigError
from surge.models import bundled_model_dir, load_model_spec


def test_bundled_spec_reads_sentence_transformers_config():
    spec = load_model_spec(bundled_model_dir())
    assert spec.name == "all-MiniLM-L6-v2"
    assert (spec.pooling, spec.normalize, spec.max_length, spec.hidden_size) == ("mean", True, 256, 384)


def test_cls_pooling_and_no_normalize(tmp_path):
    src = bundled_model_dir()
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "pool", "type": "sentence_transformers.models.Pooling"},
    ]))
    (tmp_path / "pool").mkdir()
    (tmp_path / "pool" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    spec = load_model_spec(tmp_path)
    assert (spec.pooling, spec.normalize, spec.max_length) == ("cls", False, 512)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        load_model_spec(tmp_path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_spec(tmp_path / "nope")

"""What `surge optimize` writes and refuses: the artifact carries everything the source model directory
tells the server (prompts, sentence-transformers modules), and bad input is a clear error before the slow
steps, never a traceback or an hour lost."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from surge.cli.main import app
from surge.models import load_model_spec
from surge.optimize.pipeline import OptimizeOptions, optimize
from tests.conftest import CACHE_DIR
from tests.unit.optimize.conftest import make_tiny_bert

N = 16


def _options(sentences, **kw) -> OptimizeOptions:
    return OptimizeOptions(calibration=sentences[:N], heldout=sentences[200:200 + N], measure_latency=False,
                           threads=2, **kw)


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    """A sentence-transformers directory with prompts (as e5 / bge / nomic ship them) whose Pooling module
    is not in `1_Pooling` (sentence-transformers names module folders by index and class)."""
    root = make_tiny_bert(tmp_path_factory.mktemp("st") / "model", seed=11)
    (root / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "2_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (root / "2_Pooling").mkdir()
    (root / "2_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                 "pooling_mode_cls_token": True}))
    (root / "3_Normalize").mkdir()
    (root / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"}))
    return root


def test_artifact_keeps_the_prompts_and_pooling_module_of_its_source(tmp_path, st_model, sentences):
    spec = load_model_spec(st_model)
    assert spec.pooling == "cls" and spec.normalize and spec.default_prompt_name == "query"
    result = optimize(spec, tmp_path / "art", _options(sentences), CACHE_DIR)
    assert result.written
    # `surge serve --artifact` reads the artifact as a model directory: it must say what the source says.
    served = load_model_spec(result.artifact)
    assert (served.pooling, served.normalize) == (spec.pooling, spec.normalize)
    assert served.prompts == spec.prompts and served.default_prompt_name == "query"
    m = json.loads((result.artifact / "manifest.json").read_text())
    assert m["pooling"] == served.pooling and m["normalize"] == served.normalize
    assert m["max_length"] == served.max_length

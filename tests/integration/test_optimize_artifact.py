"""What `surge optimize` writes and refuses: the artifact carries everything the source model directory
tells the server (prompts, sentence-transformers modules), and bad input is a clear error before the slow
steps, never a traceback or an hour lost."""

from __future__ import annotations

import json

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


def _cli(*args):
    return CliRunner().invoke(app, ["optimize", *map(str, args)])


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path):
    """A non-empty folder that is not an artifact (or a file) is refused at once: before the export, the
    reference run and the searches, not after them, and never as a traceback."""
    model = make_tiny_bert(tmp_path / "model", seed=12)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    a_file = tmp_path / "file.onnx"
    a_file.write_text("x")
    cache = tmp_path / "cache"
    for out in (taken, a_file, model):  # the model directory itself is not an artifact either
        result = _cli(model, "-o", out, "--no-latency", "--threads", "2", "--max-sentences", N, "--cache-dir", cache)
        assert result.exit_code == 1, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert "refusing to overwrite" in result.output and str(out.name) in result.output
        assert not cache.exists()  # nothing was exported: the check came first
    assert (taken / "notes.txt").read_text() == "mine" and a_file.read_text() == "x"


@pytest.mark.parametrize("args,word", [(["--min-cosine", "1.5"], "--min-cosine"),
                                       (["--min-top1", "-0.1"], "--min-top1"),
                                       (["--min-top1-strict", "nan"], "--min-top1-strict"),
                                       (["--min-rank-tau", "1.5"], "--min-rank-tau"),
                                       (["--min-speedup", "-1"], "--min-speedup")])
def test_thresholds_out_of_range_are_clear_errors_before_any_work(tmp_path, args, word):
    cache = tmp_path / "cache"
    result = _cli(make_tiny_bert(tmp_path / "model", seed=12), "-o", tmp_path / "art", *args, "--cache-dir", cache)
    assert result.exit_code == 1 and word in result.output, result.output
    assert not cache.exists()


def test_a_reranker_with_too_few_sentences_is_a_clear_error(tmp_path):
    from tests.task_models import task_models_dir

    cache = tmp_path / "cache"
    result = _cli(task_models_dir() / "ce", "-o", tmp_path / "art", "--max-sentences", "10", "--no-latency",
                  "--cache-dir", cache)
    assert result.exit_code == 1, (result.output, result.exception)
    assert "--max-sentences" in result.output and "28" in result.output
    assert not cache.exists()


def test_a_reranker_is_gated_and_reported_on_long_pairs_with_its_floors_from_the_cli(tmp_path):
    """The reranker's long pair set (optimize/long_inputs.py) is in the artifact's validation report and the
    printed table, and its floors are the CLI's where given."""
    from surge.optimize.validate import BUDGETS
    from tests.task_models import task_models_dir

    out = tmp_path / "art"
    args = [task_models_dir() / "ce", "-o", out, "--max-sentences", "28", "--no-latency", "--threads", "2",
            "--min-rank-tau", "0.5", "--min-rank-score", "0.6", "--cache-dir", CACHE_DIR]
    result = CliRunner().invoke(app, ["optimize", *map(str, args)], env={"COLUMNS": "200"})  # the table unwrapped
    assert result.exit_code == 0, result.output
    validation = json.loads((out / "manifest.json").read_text())["validation"]
    assert validation["budget"] == {**BUDGETS["fp32"].to_json(), "rank_tau": 0.5, "rank_score": 0.6}
    long = validation["sets"]["long"]
    assert long["long_inputs"] and long["rank_tau"] is not None and long["rank_score"] is not None
    row = next(line for line in result.output.splitlines() if line.lstrip("│ ").startswith("long "))  # its table row
    assert "rank tau" in result.output and f"{long['rank_tau']:.3f}" in row


def test_a_threshold_override_keeps_the_budget_the_run_would_use(tmp_path):
    """--min-cosine with --prune-heads moves one floor of the pruning budget (LOSSY), not of FP32's far
    stricter one, which no pruned model meets."""
    from surge.optimize.validate import LOSSY

    out = tmp_path / "art"
    result = _cli(make_tiny_bert(tmp_path / "model", seed=12), "-o", out, "--prune-heads", "0.25", "--min-cosine", "0.9",
                  "--force", "--no-latency", "--threads", "2", "--max-sentences", N, "--cache-dir", CACHE_DIR)
    assert result.exit_code == 0, result.output
    budget = json.loads((out / "manifest.json").read_text())["validation"]["budget"]
    assert budget == {**LOSSY.to_json(), "mean_cosine": 0.9}


@pytest.mark.parametrize("args,word", [(["--precision", "fp16", "--block", "LayerNorm"], "LayerNorm"),
                                       (["--precision", "int8", "--block", "Softmax"], "--block")])
def test_a_block_list_that_cannot_apply_is_a_clear_error_before_any_work(tmp_path, args, word):
    """A misspelt op type (LayerNorm for LayerNormalization) kept nothing in FP32, silently; a block list
    for a precision that has none was ignored, silently."""
    cache = tmp_path / "cache"
    result = _cli(make_tiny_bert(tmp_path / "model", seed=12), "-o", tmp_path / "art", *args, "--no-latency",
                  "--max-sentences", N, "--threads", "2", "--cache-dir", cache)
    assert result.exit_code == 1 and word in result.output, result.output
    assert not cache.exists() and not (tmp_path / "art").exists()

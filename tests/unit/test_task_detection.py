"""The task of a model directory: architectures, labels, problem_type, cross-encoder files,
overrides (model.yaml `task:`, --task), decoders, and architectures surge refuses."""

from __future__ import annotations

import json
import shutil

import pytest

from surge.config import HeadFile, ModelFile
from surge.errors import ConfigError
from surge.models import bundled_model_dir, load_model_spec
from surge.models.tasks import check_servable


def _dir(tmp_path, name, **config):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 32, **config}))
    shutil.copy(bundled_model_dir() / "tokenizer.json", d / "tokenizer.json")
    return d


def test_bundled_is_embed():
    spec = load_model_spec(bundled_model_dir())
    assert spec.task == "embed" and spec.labels == ()


def test_sequence_classification_labels_and_problem_type(tmp_path):
    d = _dir(tmp_path, "c", architectures=["BertForSequenceClassification"],
             id2label={"1": "positive", "0": "negative", "2": "neutral"})
    spec = load_model_spec(d)
    assert spec.task == "classify" and spec.labels == ("negative", "positive", "neutral")
    assert not spec.task_info.multi_label
    m = load_model_spec(_dir(tmp_path, "m", architectures=["RobertaForSequenceClassification"],
                             model_type="roberta", problem_type="multi_label_classification",
                             id2label={"0": "a", "1": "b"}))
    assert m.task == "classify" and m.task_info.multi_label


def test_one_label_is_a_reranker_and_cross_encoder_files(tmp_path):
    d = _dir(tmp_path, "ce", architectures=["BertForSequenceClassification"], id2label={"0": "LABEL_0"})
    assert load_model_spec(d).task == "rerank"
    (d / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "CrossEncoder"}))
    assert load_model_spec(d).task == "rerank"


def test_token_classification(tmp_path):
    d = _dir(tmp_path, "t", architectures=["DistilBertForTokenClassification"], model_type="distilbert",
             id2label={"0": "O", "1": "B-LOC", "2": "I-LOC"})
    spec = load_model_spec(d)
    assert spec.task == "token-classify" and spec.labels == ("O", "B-LOC", "I-LOC")


def test_decoder_is_generate_and_refused_by_the_encoder_path(tmp_path):
    d = _dir(tmp_path, "g", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    spec = load_model_spec(d)
    assert spec.task == "generate"
    with pytest.raises(ConfigError) as err:
        check_servable(spec.task_info, spec.model_type, spec.path)
    msg = err.value.message
    assert "GPT2LMHeadModel" in msg and "ForSequenceClassification" in msg and "ForTokenClassification" in msg
    assert load_model_spec(_dir(tmp_path, "l", architectures=["LlamaForCausalLM"], model_type="llama")).task == "generate"


def test_unsupported_architecture_names_it(tmp_path):
    d = _dir(tmp_path, "qa", architectures=["BertForQuestionAnswering"])
    with pytest.raises(ConfigError, match="BertForQuestionAnswering.*supported"):
        load_model_spec(d)
    e = _dir(tmp_path, "t5", architectures=["T5EncoderModel"], model_type="t5")
    spec = load_model_spec(e)  # a bare backbone: embed, but not a type the engines run
    with pytest.raises(ConfigError, match="t5"):
        check_servable(spec.task_info, spec.model_type, spec.path)


def test_overrides(tmp_path):
    c = _dir(tmp_path, "c", architectures=["BertForSequenceClassification"], id2label={"0": "a", "1": "b"})
    assert load_model_spec(c, task="embed").task == "embed"  # the backbone, pooled
    with pytest.raises(ConfigError, match="needs a \\*ForSequenceClassification"):
        load_model_spec(bundled_model_dir(), task="classify")
    with pytest.raises(ConfigError, match="one label"):
        load_model_spec(c, task="rerank")
    with pytest.raises(ConfigError, match="task must be one of"):
        load_model_spec(c, task="summarize")


def test_model_yaml_task_and_heads():
    m = ModelFile.model_validate({"task": "classify", "heads": [{"name": "intent", "task": "classify", "source": "x"},
                                                                 {"name": "emb", "task": "embed"}]})
    assert m.task == "classify" and [h.name for h in m.heads] == ["intent", "emb"]
    with pytest.raises(ValueError, match="needs a source"):
        HeadFile(name="slots", task="token-classify")
    with pytest.raises(ValueError):
        ModelFile.model_validate({"task": "summarize"})

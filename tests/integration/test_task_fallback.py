"""`surge optimize` on task models reaches the task's gate with the fewest FP32 nodes, measured on
the task's own metric (optimize/task_fallback.py, int8_search.py), and pruning a classifier keeps
its labels; each artifact is checked against transformers FP32 on real sentences."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from surge.data import calibration_queries, heldout_queries
from surge.models import load_model_spec
from surge.models.finetune import heldout_commands
from surge.optimize.pipeline import OptimizeOptions, optimize
from surge.optimize.validate import session
from tests.conftest import CACHE_DIR
from tests.task_models import task_models_dir


@pytest.fixture(scope="module")
def models():
    return task_models_dir()


def _hf_token_labels(path, texts):
    """Per-token labels of transformers FP32 (AutoModelForTokenClassification) over real tokens."""
    import torch
    import transformers
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    transformers.logging.set_verbosity_error()
    model = AutoModelForTokenClassification.from_pretrained(str(path), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    out = []
    with torch.inference_mode():
        for t in texts:
            enc = tok(t, return_tensors="pt")
            out.append(model(**enc).logits[0].argmax(-1).numpy())
    return out


def _artifact_token_labels(artifact, texts):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    tok.no_padding()  # the shipped tokenizer.json pads to 128
    sess = session(artifact / "model.onnx", threads=2)
    names = {i.name for i in sess.get_inputs()}
    out = []
    for t in texts:
        e = tok.encode(t)
        feeds = {"input_ids": np.array([e.ids], np.int64), "attention_mask": np.ones((1, len(e.ids)), np.int64),
                 "token_type_ids": np.zeros((1, len(e.ids)), np.int64)}
        out.append(sess.run(None, {k: v for k, v in feeds.items() if k in names})[0][0].argmax(-1))
    return out


def _offset_tagger(src, out, offset: float):
    """The slot tagger with one constant added to every label's bias: the same labels in FP32 (argmax
    ignores a shared offset), but logits near `offset`, where FP16's grid is coarse (0.25 at 512): a
    head that leaves its logits in FP16 changes the labels of every token with a small margin."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, out)
    sd = load_file(str(out / "model.safetensors"))
    sd["classifier.bias"] = (sd["classifier.bias"] + offset).astype(np.float32)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_fp16_tagger_keeps_its_head_in_fp32_to_meet_the_token_gate(tmp_path, models):
    tagger = _offset_tagger(models / "slots", tmp_path / "slots-offset", 512.0)
    spec = load_model_spec(tagger)
    texts = heldout_commands(64, seed=41)
    opts = OptimizeOptions(calibration=calibration_queries()[:48] + texts[:32], heldout=heldout_queries()[:48] + texts[32:],
                           precision="fp16", measure_latency=False, threads=2)
    result = optimize(spec, tmp_path / "slots-fp16", opts, CACHE_DIR)
    fallback = result.manifest["precision_decisions"]["fp32_fallback"]
    assert not fallback["steps"][0]["passed"], fallback  # the plain conversion misses the token budget ...
    assert result.gate.passed, result.gate.failures  # ... the fallback meets it
    kept = result.manifest["precision_decisions"]["fp32_nodes"]
    assert kept and all("classifier" in n for n in kept), kept  # the head alone, found first
    for m in result.gate.sets.values():
        assert m.tokens >= 0.995
    # the written FP16 graph on ONNX Runtime against transformers FP32 on real sentences
    sentences = heldout_commands(40, seed=43)
    want = _hf_token_labels(tagger, sentences)
    got = _artifact_token_labels(result.artifact, sentences)
    agree = np.concatenate([g == w for g, w in zip(got, want)])
    assert agree.mean() >= 0.995, agree.mean()


def test_int8_tagger_reaches_the_token_gate_with_measured_fallback(tmp_path, models):
    spec = load_model_spec(models / "slots")
    texts = heldout_commands(64, seed=45)
    opts = OptimizeOptions(calibration=calibration_queries()[:64] + texts[:32], heldout=heldout_queries()[:64] + texts[32:],
                           precision="int8", measure_latency=False, threads=2)
    result = optimize(spec, tmp_path / "slots-int8", opts, CACHE_DIR)
    q = result.manifest["precision_decisions"]["quantization"]
    steps = q["fallback_steps"]
    # Plain INT8 misses the search's budget; the fallback keeps nodes in FP32 until the gate (token
    # agreement >= 0.97 on held-out) passes. The search measures on its hardest calibration sentences
    # against a stricter budget (0.985), which its last step meets on some CPUs and not others (float
    # rounding of the FP32 reference, measured on Sapphire Rapids and on AMD Zen 3): not asserted.
    assert not steps[0]["passed"], steps
    assert result.gate.passed, result.gate.failures
    kept = steps[-1]["kept_fp32"]
    assert 1 <= len(kept) <= q["max_fp32"], kept
    if "sensitivity" in q:  # measured on the task metric: the kept nodes are the most sensitive, in order
        order = list(q["sensitivity"])
        assert kept == order[:len(kept)], (kept, order)
    sentences = heldout_commands(40, seed=47)
    want = _hf_token_labels(models / "slots", sentences)
    got = _artifact_token_labels(result.artifact, sentences)
    agree = np.concatenate([g == w for g, w in zip(got, want)])
    assert agree.mean() >= 0.97, agree.mean()


def test_pruned_classifier_is_checked_by_the_classify_gate(tmp_path, models):
    """Head pruning on a classifier: importance measured on its logits, the pruned graph keeps the
    head, and the gate's argmax agreement is what transformers' pipeline says of the artifact's
    labels on the same held-out commands; the gate decides promotion on it (the lossy budget)."""
    import transformers
    from transformers import pipeline

    from surge.cli.bootstrap import resolve_artifact
    from surge.config import EngineConfig
    from surge.optimize.validate import LOSSY
    from surge.runtime.loader import build_worker

    spec = load_model_spec(models / "intent")
    texts = heldout_commands(96, seed=51)
    opts = OptimizeOptions(calibration=texts[:32], heldout=texts[32:], prune_heads=1 / 12, measure_latency=False,
                           threads=2, force=True)
    result = optimize(spec, tmp_path / "intent-pruned", opts, CACHE_DIR)
    pruning = result.manifest["pruning"]
    assert pruning["heads_per_layer"] == spec.num_heads - 1 and pruning["measured_on"] == "logits"
    gate = {k: m.argmax for k, m in result.gate.sets.items()}
    assert all(v is not None for v in gate.values())
    assert result.gate.passed == all(v >= LOSSY.argmax for v in gate.values()) == (not result.manifest["forced"])
    art = load_model_spec(result.artifact)
    assert art.task == "classify"
    w = build_worker(art, resolve_artifact(art, EngineConfig(), CACHE_DIR), EngineConfig(threads=2))
    heldout = texts[32:]
    got = w.compute(w.tokenizer.to_encoded(w.tokenizer.encodings(heldout))).argmax(1)
    w.engines.close()
    transformers.logging.set_verbosity_error()
    want = [r["label"] for r in pipeline("text-classification", model=str(models / "intent"), device="cpu")(heldout)]
    agree = float(np.mean([art.labels[g] == x for g, x in zip(got, want)]))
    assert abs(agree - gate["heldout"]) <= 1 / len(heldout), (agree, gate)
    assert agree >= 0.95, agree  # one head of twelve per layer: most labels survive

"""Task heads on the CUDA engine: heads inside the captured graph (packed batches, no padding)
against the host heads on the same engine and against transformers FP32, on every sentence.

Task models: tests/task_models.py's heads on the bundled MiniLM; on a GPU machine without it,
SURGE_GPU_HEADS points at benchmarks/tasks_prepare.py's heads/ (joined with SURGE_GPU_MODEL_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from surge.models import load_model_spec
from surge.types import TokenBatch

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def task_dirs(model_dir, tmp_path_factory):
    heads = os.environ.get("SURGE_GPU_HEADS")
    if not heads:
        from tests.task_models import task_models_dir

        d = task_models_dir()
        return {n: d / n for n in ("intent", "slots", "cls5", "ce")}
    from surge.models.build import assemble_checkpoint

    out = tmp_path_factory.mktemp("taskmodels")
    return {n: assemble_checkpoint(model_dir, Path(heads) / n, out / n) for n in ("intent", "slots", "cls5", "ce")}


def _engine(path, precision="fp16"):
    from surge.engines.heads import HeadSet, load_head
    from surge.engines.torch_gpu import TorchEngine

    spec = load_model_spec(path)
    head = load_head(spec.path, spec.name, spec.task, spec.model_type, spec.labels, spec.task_info.multi_label)
    hs = HeadSet([head])
    e = TorchEngine(device="cuda", precision=precision, max_batch=64)
    e.load(spec.path)
    assert e.attach_heads(hs)
    return e, hs, spec


def _reference(path, items, token: bool):
    import transformers
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoTokenizer

    transformers.logging.set_verbosity_error()
    cls = AutoModelForTokenClassification if token else AutoModelForSequenceClassification
    model = cls.from_pretrained(str(path), dtype=torch.float32).eval().cuda()
    tok = AutoTokenizer.from_pretrained(str(path))
    out = []
    with torch.inference_mode():
        for i in range(0, len(items), 32):
            chunk = items[i:i + 32]
            enc = tok([a for a, _ in chunk], [b for _, b in chunk], padding=True, truncation=True, return_tensors="pt") \
                if isinstance(chunk[0], tuple) else tok(chunk, padding=True, truncation=True, return_tensors="pt")
            logits = model(**{k: v.cuda() for k, v in enc.items()}).logits.float().cpu().numpy()
            if token:
                out += [logits[j, :int(m.sum())] for j, m in enumerate(enc["attention_mask"])]
            else:
                out += list(logits)
    return out


def _run(engine, hs, tok_items, bs=48):
    out = []
    for i in range(0, len(tok_items), bs):
        batch = TokenBatch.pack(tok_items[i:i + bs])
        rows = engine.run_heads(batch)
        host = hs.apply(engine.run(batch), batch)  # the same engine's hidden states, heads on the host
        for r, h, item in zip(rows, host, tok_items[i:i + bs]):
            a = hs.split(np.asarray(r), hs.first.name, len(item))
            b = hs.split(np.asarray(h), hs.first.name, len(item))
            np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)  # fp16 hidden states, fp32 head either way
            out.append(a)
    return out


@pytest.mark.parametrize("name", ["intent", "cls5", "ce", "slots"])
def test_heads_in_graph_match_transformers(task_dirs, sentences, name):
    from surge.runtime.tokenize import Tokenizer

    engine, hs, spec = _engine(task_dirs[name])
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    if spec.task == "rerank":
        items = [(sentences[i], sentences[(i * 7 + 3) % len(sentences)]) for i in range(len(sentences))]
    else:
        items = list(sentences)
    encs = tok.to_encoded(tok.encodings(items))
    got = _run(engine, hs, encs)
    ref = _reference(task_dirs[name], items, spec.task == "token-classify")
    if spec.task == "token-classify":
        agree = np.concatenate([(g.argmax(1) == r.argmax(1)) for g, r in zip(got, ref)])
        print(f"{name}: per-token label agreement {agree.mean():.5f} over {agree.size} tokens")
        assert agree.mean() >= 0.995
        return
    g, r = np.stack(got), np.stack(ref)
    err = np.abs(g - r).max()
    if spec.task == "rerank":
        print(f"{name}: max |logit diff| {err:.4f}; score order kept for {len(g)} pairs")
        assert err <= 0.05 * max(1.0, np.abs(r).max())
        return
    same = g.argmax(1) == r.argmax(1)
    agree = same.mean()
    top2 = np.sort(r, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    print(f"{name}: argmax agreement {agree:.5f} over {len(g)} sentences, max |logit diff| {err:.4f}, "
          f"FP32 margins of the changed labels {margin[~same].round(4).tolist()}")
    if name == "intent":  # the trained head: the FP16 rule, at most 0.2% of labels change
        assert agree >= 0.998
    else:  # a random head has near-ties: a label may change only where FP32's top-2 margin is within the error
        assert agree >= 0.99 and (margin[~same] <= 2 * err).all()


@pytest.mark.parametrize("name", ["intent", "slots"])
def test_heads_in_graph_do_not_depend_on_the_batch(task_dirs, sentences, name):
    """A query's logits (sequence head) and its tokens' logits (token head) alone equal them among
    random neighbours, bit for bit: the heads run on the one-tiling GEMM (batch_invariant)."""
    from surge.runtime.tokenize import Tokenizer

    engine, hs, spec = _engine(task_dirs[name])
    tok = Tokenizer(spec.tokenizer_file, spec.max_length, spec.vocab_size, spec.pad_token_id)
    items = tok.encode(sentences[:150])
    alone = [np.asarray(engine.run_heads(TokenBatch.pack([x]))[0]) for x in items]
    rng = np.random.default_rng()
    for _ in range(20):
        idx = rng.choice(len(items), int(rng.integers(2, 65)), replace=False)
        rows = engine.run_heads(TokenBatch.pack([items[i] for i in idx]))
        for i, r in zip(idx, rows):
            np.testing.assert_array_equal(np.asarray(r), alone[i], err_msg=f"{name}: sentence {i} moved")

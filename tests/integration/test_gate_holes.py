"""Two ways a broken candidate used to pass the accuracy gate (optimize/validate.py), each refused now:

1. a classifier / tagger that always answers the commonest label passes label (token) agreement
   wherever that label covers more of the inputs than the floor; Cohen's kappa (task_metrics.py) is 0
   for it, and the gate has a floor on kappa;
2. a candidate broken only past 128 tokens (the length the calibration and held-out sets are cut
   at) while serving goes to the model's max length; the gate now has a long-input set
   (optimize/long_inputs.py) that reaches the max length.

Candidates are real ONNX graphs (the exported FP32 task / embedding graph with its weights edited)
run by ONNX Runtime against the FP32 reference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from surge.data import heldout_queries
from surge.models import load_model_spec
from surge.optimize.export import ensure_exported
from surge.optimize.long_inputs import SHORT, long_texts
from surge.optimize.task_metrics import cohen_kappa
from surge.optimize.validate import BUDGETS, Encoded, Evaluator, run_model, session
from tests.conftest import CACHE_DIR
from tests.task_models import task_models_dir


def _set_initializer(model: onnx.ModelProto, name: str, value: np.ndarray) -> None:
    init = next(i for i in model.graph.initializer if i.name == name)
    init.CopyFrom(numpy_helper.from_array(value.astype(numpy_helper.to_array(init).dtype), name))


def _always(src, label: int, labels: int) -> bytes:
    """The task graph with its logits replaced by 0 * logits + a one-hot vector on `label`: every
    input (every token) gets `label`, whatever the text."""
    model = onnx.load(str(src))
    for node in model.graph.node:
        node.output[:] = ["raw_logits" if o == "logits" else o for o in node.output]
    model.graph.initializer.extend([numpy_helper.from_array(np.zeros((), np.float32), "zero"),
                                    numpy_helper.from_array(np.eye(labels, dtype=np.float32)[label] * 10, "onehot")])
    model.graph.node.extend([onnx.helper.make_node("Mul", ["raw_logits", "zero"], ["zeroed"]),
                             onnx.helper.make_node("Add", ["zeroed", "onehot"], ["logits"])])
    return model.SerializeToString()


def _skewed_sets(spec, src, majority_share: float):
    """Calibration and held-out sentences out of the shipped queries on which the FP32 model's commonest
    label covers at least `majority_share` of the labels (of the tokens, for a tagger), and some other
    label occurs: the sets where plain agreement cannot tell a degenerate candidate from a good one."""
    texts = heldout_queries()[:800]
    out = run_model(session(src, threads=2), spec, Encoded(spec, texts))
    if out.token_rows is not None:
        labels = np.concatenate([t.argmax(1) for t in out.logits])
        common = int(np.bincount(labels).argmax())
        other = np.bincount(out.token_rows, weights=labels != common, minlength=len(texts))
        plain = [t for t, k in zip(texts, other) if k == 0]
        mixed = [t for t, k in zip(texts, other) if k == 1]  # one token of another label each
        count = np.bincount(out.token_rows, minlength=len(texts))
        per = float(np.mean([c for c, k in zip(count, other) if k == 0]))
        n_plain = int(np.ceil(1 / ((1 - majority_share) * per)))  # one mixed sentence per n_plain plain ones
    else:
        labels = out.logits.argmax(1)
        common = int(np.bincount(labels).argmax())
        plain = [t for t, lab in zip(texts, labels) if lab == common]
        mixed = [t for t, lab in zip(texts, labels) if lab != common]
        n_plain = int(np.ceil(1 / (1 - majority_share)))
    sets = []
    for part in (0, 1):
        take = plain[part::2][:n_plain + 4]
        sets.append(take + mixed[part::2][:1])
    return common, sets


@pytest.mark.parametrize("name,budget,metric", [("slots", "int8", "tokens"), ("cls5", "int8", "argmax")])
def test_an_always_majority_candidate_is_refused(name, budget, metric):
    spec = load_model_spec(task_models_dir() / name)
    src = ensure_exported(spec, CACHE_DIR) / "model.onnx"
    floor = getattr(BUDGETS[budget], metric)
    common, (calibration, heldout) = _skewed_sets(spec, src, floor + (1 - floor) / 2)
    ev = Evaluator(spec, src, calibration, heldout, threads=2)
    gate = ev.gate(_always(src, common, len(spec.labels)), BUDGETS[budget], sets=("calibration", "heldout"))
    for m in gate.sets.values():  # plain agreement meets its floor: the hole ...
        assert getattr(m, metric) >= floor, (metric, getattr(m, metric))
        assert m.kappa == pytest.approx(0.0, abs=1e-9)  # ... that kappa closes
    assert not gate.passed
    assert any("heldout: kappa" in f for f in gate.failures), gate.failures
    assert "kappa" in gate.to_json()["sets"]["heldout"]  # in the report
    assert ev.gate(src.read_bytes(), BUDGETS["fp32"]).passed  # the FP32 graph itself: kappa 1


def test_cohen_kappa():
    assert cohen_kappa([0, 0, 1, 1], [0, 1, 1, 1]) == pytest.approx(0.5)  # p_o 0.75, chance 0.5
    assert cohen_kappa([0] * 97 + [1] * 3, [0] * 100) == pytest.approx(0.0)  # 97% agreement, nothing learnt
    assert cohen_kappa([2, 2, 2], [2, 2, 2]) == 1.0
    assert cohen_kappa([0, 1, 2], [1, 2, 0]) < 0


def _zero_positions_past(src, start: int) -> bytes:
    """The graph with its position embeddings from `start` on zeroed: identical on inputs up to
    `start` tokens, wrong on every longer one."""
    model = onnx.load(str(src))
    init = next(i for i in model.graph.initializer if i.name.endswith("position_embeddings.weight"))
    table = numpy_helper.to_array(init).copy()
    table[start:] = 0.0
    _set_initializer(model, init.name, table)
    return model.SerializeToString()


@pytest.mark.parametrize("name", ["bundled", "slots"])
def test_a_candidate_broken_past_128_tokens_is_refused(name, bundled_spec):
    spec = bundled_spec if name == "bundled" else load_model_spec(task_models_dir() / name)
    assert spec.max_length > SHORT
    src = ensure_exported(spec, CACHE_DIR) / "model.onnx"
    texts = heldout_queries()
    ev = Evaluator(spec, src, texts[:48], texts[200:248], threads=2)
    long = ev.data["long"]
    lengths = [int(b.attention_mask.sum(1).max()) for b in long.batches]
    assert min(int(b.attention_mask.sum(1).min()) for b in long.batches) > SHORT
    assert max(lengths) == spec.max_length  # the set reaches what the server accepts
    broken = _zero_positions_past(src, SHORT)
    gate = ev.gate(broken, BUDGETS["int8"])
    short = {k: v for k, v in gate.sets.items() if k != "long"}
    assert all(m.max_abs_diff == 0.0 for m in short.values())  # the short sets cannot see it ...
    assert not gate.passed and all(f.startswith("long:") for f in gate.failures), gate.failures  # ... the long set does
    assert ev.gate(src.read_bytes(), BUDGETS["fp32"]).passed


def test_long_texts_spread_up_to_the_max_length(bundled_spec):
    from tokenizers import Tokenizer

    texts = long_texts(bundled_spec, heldout_queries()[:100], count=5)
    tok = Tokenizer.from_file(str(bundled_spec.tokenizer_file))
    tok.no_truncation()
    tok.no_padding()
    lengths = [len(e.ids) for e in tok.encode_batch(texts)]
    targets = np.linspace(SHORT + 1, bundled_spec.max_length, 5).round()
    assert all(n >= t for n, t in zip(lengths, targets)), (lengths, targets)
    assert long_texts(bundled_spec, heldout_queries()[:100]) and len(long_texts(bundled_spec, heldout_queries()[:100])) == 8


# Rerankers: a pair is a query and a document, and rerank traffic carries long documents; the two
# sets (8 queries x 20 one-sentence documents, cut at 128 tokens) never reach past 128 tokens.

def _clamp_positions_past(src, start: int) -> bytes:
    """The graph with every position from `start` on reading the embedding of position `start` - 1 (a
    position table cut to `start` rows whose lookup clamps): identical on pairs up to `start` tokens."""
    model = onnx.load(str(src))
    init = next(i for i in model.graph.initializer if i.name.endswith("position_embeddings.weight"))
    table = numpy_helper.to_array(init).copy()
    table[start:] = table[start - 1]
    _set_initializer(model, init.name, table)
    return model.SerializeToString()


@pytest.fixture(scope="module")
def reranker():
    spec = load_model_spec(task_models_dir() / "ce")
    src = ensure_exported(spec, CACHE_DIR) / "model.onnx"
    from surge.data import calibration_queries

    # 28 sentences a set: the fewest a reranker's gate takes (8 queries, 20 documents)
    return spec, src, Evaluator(spec, src, calibration_queries()[:28], heldout_queries()[:28], threads=2)


def test_a_reranker_has_a_long_pair_set_up_to_the_max_length(reranker):
    from tokenizers import Tokenizer

    from surge.optimize.long_inputs import long_rerank_pairs
    from surge.optimize.task_metrics import RERANK_QUERIES

    spec, _, ev = reranker
    assert spec.task == "rerank" and spec.max_length > SHORT
    pairs = ev.data["long"].texts
    queries = heldout_queries()[:RERANK_QUERIES]
    assert pairs == long_rerank_pairs(spec, heldout_queries()[:28])
    assert [q for q, _ in pairs] == [q for q in queries for _ in range(len(pairs) // RERANK_QUERIES)]  # query-major
    docs = [d for _, d in pairs[:len(pairs) // RERANK_QUERIES]]
    assert all(d == pairs[i][1] for i, d in enumerate(docs * RERANK_QUERIES))  # each query ranks the same documents
    assert not set(docs) & set(queries)
    tok = Tokenizer.from_file(str(spec.tokenizer_file))
    tok.no_truncation()
    tok.no_padding()
    for q in queries:  # every pair past 128 tokens, spread up to (and truncated at) the max length
        lengths = [len(tok.encode(q, d).ids) for d in docs]
        assert min(lengths) > SHORT and max(lengths) >= spec.max_length and lengths == sorted(lengths), lengths
    served = [int(b.attention_mask.sum(1).max()) for b in ev.data["long"].batches]
    assert max(served) == spec.max_length


def test_a_reranker_broken_past_128_tokens_is_refused(reranker):
    """A reranker artifact whose positions past 128 are wrong ranks every short pair as its source does;
    on long pairs its rankings move: the long pair set refuses it, for INT8's loose budget too."""
    from surge.optimize import precision as prec
    from surge.optimize.task_metrics import RERANK_QUERIES

    _, src, ev = reranker
    broken = _clamp_positions_past(src, SHORT)
    gate = ev.gate(broken, BUDGETS["int8"])
    short = {k: v for k, v in gate.sets.items() if k != "long"}
    assert set(short) == {"calibration", "heldout"}
    assert all(m.max_abs_diff == 0.0 and m.rank_tau == 1.0 and m.rank_score == 1.0 for m in short.values())  # unseen
    assert not gate.passed and all(f.startswith("long:") for f in gate.failures), gate.failures
    assert any("rank_tau" in f for f in gate.failures), gate.failures
    report = gate.to_json()["sets"]["long"]  # in the optimizer's report, as the other sets
    assert report["long_inputs"] and report["n"] == RERANK_QUERIES  # a reranker's set counts its queries
    assert report["rank_tau"] < BUDGETS["int8"].rank_tau and report["rank_score"] is not None
    assert ev.gate(src.read_bytes(), BUDGETS["fp32"]).passed  # the FP32 export itself
    # a faithful candidate that is not the source: FP16 (emulated as the optimizer validates it)
    fp16 = prec.emulate(prec.convert(onnx.load(str(src)), "fp16", list(prec.DEFAULT_BLOCK_LIST)), "fp16")
    gate16 = ev.gate(fp16.SerializeToString(), BUDGETS["fp16"])
    assert gate16.passed, gate16.failures
    assert 0.0 < gate16.sets["long"].max_abs_diff  # measured, not identical

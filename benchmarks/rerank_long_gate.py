"""What the reranker gate measures on candidates that are faithful and on ones broken past 128 tokens.

The test reranker (tests/task_models.py "ce": a seeded random one-label head on the bundled MiniLM,
512 positions) against its FP32 export, on 28 calibration + 28 held-out queries (8 queries x 20
documents a set) and the long pair set (8 queries x 8 documents, pairs from 129 to 512 tokens,
optimize/long_inputs.py): FP16 / BF16 as the optimizer validates them (emulated, default block list),
INT8 without any search (ORT dynamic per-channel; per-row), and three graphs whose positions past 128
are wrong (zeroed, clamped to position 127, wrapped to 0..), identical on every short pair. Prints
one row per candidate and set, and which floors of its precision's budget it misses (broken ones
against INT8's, the loosest). Why the floors in validate.BUDGETS are where they are.

    PYTHONPATH=src:. python3 benchmarks/rerank_long_gate.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import CACHE_DIR
from tests.task_models import task_models_dir


def _positions(src: Path, edit) -> bytes:
    model = onnx.load(str(src))
    init = next(i for i in model.graph.initializer if i.name.endswith("position_embeddings.weight"))
    table = numpy_helper.to_array(init).copy()
    edit(table)
    init.CopyFrom(numpy_helper.from_array(table, init.name))
    return model.SerializeToString()


def main() -> None:
    from surge.data import calibration_queries, heldout_queries
    from surge.models import load_model_spec
    from surge.optimize import precision as prec
    from surge.optimize.export import ensure_exported
    from surge.optimize.quantize import quantize_int8
    from surge.optimize.rowquant import quantize_rows
    from surge.optimize.validate import BUDGETS, Evaluator

    spec = load_model_spec(task_models_dir() / "ce")
    src = ensure_exported(spec, CACHE_DIR) / "model.onnx"
    proto = onnx.load(str(src))
    ev = Evaluator(spec, src, calibration_queries()[:28], heldout_queries()[:28], threads=2)

    def zero(t):
        t[128:] = 0.0

    def clamp(t):
        t[128:] = t[127]

    def wrap(t):
        t[128:] = t[:len(t) - 128]

    block = list(prec.DEFAULT_BLOCK_LIST)
    candidates = [
        ("fp16 (emulated)", "fp16", prec.emulate(prec.convert(proto, "fp16", block), "fp16").SerializeToString()),
        ("bf16 (emulated)", "bf16", prec.emulate(prec.convert(proto, "bf16", block), "bf16").SerializeToString()),
        ("int8 dynamic", "int8", quantize_int8(proto, per_channel=True)[0].SerializeToString()),
        ("int8 per-row", "int8", quantize_rows(proto)[0].SerializeToString()),
        ("positions >128 zeroed", "int8", _positions(src, zero)),
        ("positions >128 clamped", "int8", _positions(src, clamp)),
        ("positions >128 wrapped", "int8", _positions(src, wrap)),
    ]
    print(f"{'candidate':<24} {'set':<12} {'top-1':>6} {'NDCG@10':>8} {'tau':>6} {'score':>7}  misses ({'budget'})")
    for name, budget, model in candidates:
        gate = ev.gate(model, BUDGETS[budget])
        for set_name, m in gate.sets.items():
            missed = [f.split(": ", 1)[1].split(" ")[0] for f in gate.failures if f.startswith(set_name + ":")]
            print(f"{name:<24} {set_name:<12} {m.rank_top1:6.3f} {m.ndcg10:8.4f} {m.rank_tau:6.3f} {m.rank_score:7.4f}"
                  f"  {', '.join(missed) or '-'} ({budget})")
    print("long pair lengths (tokens, per batch max):",
          np.unique([int(b.attention_mask.sum(1).max()) for b in ev.data["long"].batches]).tolist())


if __name__ == "__main__":
    main()

"""Issue 21, session 8: distilled students by depth and by FFN width, measured on the held-out queries.

Each run trains `surge.optimize.distill.distill` (the CLI's defaults unless given), then measures the
student against the teacher in PyTorch FP32 on all held-out queries: mean / min cosine of the pooled
vectors, and the gate's retrieval agreement (strict and ties within 0.01, Wilson 95% intervals).
Runs given together share the teacher's targets when they keep the same teacher layers.

    taskset -c 1 env OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/distill_width.py \\
        --run 6:768:fp32:600 --out-dir /tmp/dw
(--run LAYERS:FFN:PRECISION:BUDGET_S[:LR], FFN 0 = the teacher's; repeatable)

    ... --gate /tmp/dw/L6_F768_fp32_600 --out-dir /tmp/dw   (the CLI's ONNX gate and latency gate on a student)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def embed(model, spec, texts, pooling):
    import torch
    import torch.nn.functional as F

    from surge.optimize.distill import _pool
    from surge.optimize.validate import Encoded

    out = []
    with torch.inference_mode():
        for b in Encoded(spec, texts, batch_size=64).batches:
            ids, mask = torch.from_numpy(b.input_ids), torch.from_numpy(b.attention_mask)
            base = getattr(model, model.base_model_prefix, model)
            out.append(F.normalize(_pool(base(input_ids=ids, attention_mask=mask).last_hidden_state, mask, pooling), dim=-1))
    return torch.cat(out).numpy()


def measure(teacher_vecs, student_vecs) -> dict:
    from surge.optimize.validate import retrieval_agreement, wilson_interval

    cos = (teacher_vecs * student_vecs).sum(1)
    strict = retrieval_agreement(teacher_vecs, student_vecs)
    ties = retrieval_agreement(teacher_vecs, student_vecs, tolerance=0.01)
    n = len(cos)
    return {"n": n, "mean_cosine": round(float(cos.mean()), 4), "min_cosine": round(float(cos.min()), 4),
            "top1": round(float(strict.mean()), 4), "top1_ci95": [round(x, 4) for x in wilson_interval(strict.sum(), n)],
            "top1_tie": round(float(ties.mean()), 4), "top1_tie_ci95": [round(x, 4) for x in wilson_interval(ties.sum(), n)]}


def main() -> None:
    import torch

    import surge.optimize.distill as D
    from surge.data import heldout_queries
    from surge.models import bundled_model_dir, load_model_spec

    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="append", default=[])
    ap.add_argument("--gate", action="append", default=[], type=Path,
                    help="a trained student directory: the CLI's gate and latency gate on it (ONNX Runtime)")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--init-only", action="store_true", help="measure the untrained students only")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = load_model_spec(bundled_model_dir())
    if args.gate:
        from rich.console import Console

        from surge.cli.distill import _gate
        from surge.config import default_cache_dir

        for student in args.gate:
            gate, latency = _gate(spec, student, 0.95, 0.90, 0, 1, True, default_cache_dir(), Console(stderr=True))
            row = {"student": str(student), "gate": gate, "latency": latency}
            (args.out_dir / f"gate_{student.name}.json").write_text(json.dumps(row, indent=1, default=str))
            held = gate["sets"]["heldout"]
            print(student.name, {k: held[k] for k in ("mean_cosine", "min_cosine", "top1", "top1_tie")},
                  [(r["batch"], r["seq"], round(r["speedup"], 3)) for r in latency["rows"]], flush=True)
        return
    pooling = str(spec.pooling)
    held = heldout_queries()
    teacher = D._load(spec)
    t_vecs = embed(teacher, spec, held, pooling)

    cached: dict = {}
    original = D._teacher_targets

    def shared_targets(teacher, encoded, batch, classifier, kept, pooling):
        key = tuple(kept)
        if key not in cached:
            cached.clear()  # one set at a time: they are GBs
            cached[key] = original(teacher, encoded, batch, classifier, kept, pooling)
        return cached[key]

    D._teacher_targets = shared_targets
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for run in args.run:
        layers, ffn, precision, budget, *lr = run.split(":")
        options = D.DistillOptions(layers=int(layers), ffn_size=int(ffn), precision=precision,
                                   time_budget=float(budget), threads=1, steps=1 if args.init_only else 20000)
        name = f"L{layers}_F{ffn}_{precision}_{budget}"
        if lr:
            options.lr = float(lr[0])
            name += f"_lr{lr[0]}"
        t0 = time.perf_counter()
        if args.init_only:
            options.lr = 1e-12
        result = D.distill(spec, args.out_dir / name, options)
        from transformers import AutoModel

        student = AutoModel.from_pretrained(str(args.out_dir / name), local_files_only=True).eval()
        row = {"run": name, "layers": int(layers), "ffn_size": int(ffn) or spec.config.get("intermediate_size"),
               "precision": precision, "budget_s": float(budget), "wall_s": round(time.perf_counter() - t0, 1),
               "heldout": measure(t_vecs, embed(student, spec, held, pooling)), **result.to_json()}
        (args.out_dir / f"{name}.json").write_text(json.dumps(row, indent=1))
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses",)}, default=str)[:1500], flush=True)


if __name__ == "__main__":
    main()

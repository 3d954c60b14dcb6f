"""Issue 21, session 8: distilled students by depth and by FFN width, measured on the held-out queries.

Each run trains `surge.optimize.distill.distill` (the CLI's defaults unless given), then measures the
student against the teacher in PyTorch FP32 on all held-out queries: mean / min cosine of the pooled
vectors, and the gate's retrieval agreement (strict and ties within 0.01, Wilson 95% intervals).
Runs given together share the teacher's targets when they keep the same teacher layers.

    taskset -c 1 env OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/distill_width.py \\
        --run 6:768:fp32:600 --out-dir /tmp/dw
(--run LAYERS:FFN:PRECISION:BUDGET_S[:LR], FFN 0 = the teacher's; repeatable)

    ... --gate /tmp/dw/L6_F768_fp32_600 --out-dir /tmp/dw   (the CLI's ONNX gate and latency gate on a student)
    ... --measure /tmp/dw/L6_F768_fp32_600 --out-dir /tmp/dw (measure a trained student again)
    ... --init --run 6:768 --run 4:0 --out-dir /tmp/dw        (untrained students: FFN sliced, random, refitted)

Session 12: `--device cuda` trains on a GPU (the measurement stays on the CPU), to see where longer
training ends: `python benchmarks/distill_width.py --device cuda --model DIR --run 4:0:fp32:480 --out-dir /tmp/dw`
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
    data = Encoded(spec, texts, batch_size=64)
    with torch.inference_mode():
        for b in data.batches:
            ids, mask = torch.from_numpy(b.input_ids), torch.from_numpy(b.attention_mask)
            base = getattr(model, model.base_model_prefix, model)
            out.append(F.normalize(_pool(base(input_ids=ids, attention_mask=mask).last_hidden_state, mask, pooling), dim=-1))
    vecs = np.empty((len(texts), out[0].shape[-1]), np.float32)
    vecs[data.order] = torch.cat(out).numpy()  # input order: retrieval_agreement's folds are contiguous input rows
    return vecs


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
    ap.add_argument("--init", action="store_true",
                    help="measure untrained students (as distill builds them) for each --run's LAYERS:FFN")
    ap.add_argument("--measure", action="append", default=[], type=Path,
                    help="a trained student directory: measure it again (PyTorch, held-out queries)")
    ap.add_argument("--device", default="cpu", help="where runs train: cpu or cuda (measured on the CPU)")
    ap.add_argument("--model", type=Path, help="the teacher's directory (default: the bundled model)")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (training on the CPU, measuring)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spec = load_model_spec(args.model or bundled_model_dir())
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

    for student_dir in args.measure:
        from transformers import AutoModel

        student = AutoModel.from_pretrained(str(student_dir), local_files_only=True).eval()
        row = json.loads((student_dir.parent / f"{student_dir.name}.json").read_text())
        row["heldout_sorted_folds"] = row.get("heldout_sorted_folds", row["heldout"])
        row["heldout"] = measure(t_vecs, embed(student, spec, held, pooling))
        (student_dir.parent / f"{student_dir.name}.json").write_text(json.dumps(row, indent=1))
        print(student_dir.name, row["heldout"], flush=True)
    if args.measure:
        return
    if args.init:
        from tokenizers import Tokenizer

        texts = D.default_texts()
        tok = Tokenizer.from_file(str(spec.tokenizer_file))
        tok.no_padding()
        tok.enable_truncation(max_length=128)
        encoded = [e.ids for e in tok.encode_batch(texts)]

        def batch(idx):
            n = max(len(encoded[i]) for i in idx)
            ids, mask = np.zeros((len(idx), n), np.int64), np.zeros((len(idx), n), np.int64)
            for r, i in enumerate(idx):
                ids[r, : len(encoded[i])], mask[r, : len(encoded[i])] = encoded[i], 1
            return torch.from_numpy(ids), torch.from_numpy(mask)

        fit = sorted(np.random.default_rng(1).choice(len(encoded), D.REFIT_TEXTS, replace=False).tolist(),
                     key=lambda i: len(encoded[i]))
        rows = []
        for run in args.run:
            layers, ffn = (int(x) for x in run.split(":")[:2])
            kept = list(range(6)) if layers == 6 else D.choose_layers(teacher, 6, layers, encoded, batch, pooling)[0]
            for how in (["-"] if not ffn or ffn == 1536 else ["sliced", "random", "refit"]):
                student = D.make_student(teacher, kept)
                if how == "sliced":
                    D.narrow_ffn(student, D.choose_ffn(student, ffn, *batch(D._choice_texts(encoded)))[0])
                elif how == "random":
                    rng = np.random.default_rng(0)
                    D.narrow_ffn(student, [sorted(rng.permutation(1536)[:ffn].tolist()) for _ in kept])
                elif how == "refit":
                    keep = D.choose_ffn(student, ffn, *batch(D._choice_texts(encoded)))[0]
                    D.refit_ffn(student, keep, (batch(fit[b : b + 64]) for b in range(0, len(fit), 64)))
                row = {"layers": layers, "kept_layers": kept, "ffn_size": ffn or 1536, "ffn": how,
                       "heldout": measure(t_vecs, embed(student.eval(), spec, held, pooling))}
                rows.append(row)
                print(json.dumps(row), flush=True)
        (args.out_dir / "init.json").write_text(json.dumps(rows, indent=1))
        return

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
                                   time_budget=float(budget), threads=args.threads, device=args.device)
        name = f"L{layers}_F{ffn}_{precision}_{budget}" + ("" if args.device == "cpu" else f"_{args.device}")
        if lr:
            options.lr = float(lr[0])
            name += f"_lr{lr[0]}"
        t0 = time.perf_counter()
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

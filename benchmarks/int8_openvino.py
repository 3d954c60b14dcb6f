"""Issue 21, session 16: OpenVINO's CPU plugin as the INT8 engine, against surge's ONNX Runtime artifacts.

Why look: OpenVINO quantizes a FullyConnected's activations *inside* the kernel when its weights are compressed
to int8 (`DYNAMIC_QUANTIZATION_GROUP_SIZE`: per token and group of K, batch invariant by construction), on
AMX / VNNI, with its own fusions of LayerNorm, GELU and attention: one node where the INT8 artifact runs a
per-row chain of ~12 ONNX Runtime operators. Measured here, one thread, length-sorted batches of held-out
queries, interleaved rounds: ONNX Runtime FP32 and INT8 (the two artifacts `surge optimize` writes), OpenVINO FP32
(f32 inference precision forced: on AMX machines it otherwise runs BF16) and OpenVINO with int8 weights
(NNCF `compress_weights`, symmetric per channel) at dynamic quantization group 32, whole rows, and off; cosine of
each pooled sentence vector against ONNX Runtime FP32.

OpenVINO and NNCF are not project dependencies: `pip install openvino nncf` first.

    python3 benchmarks/int8_openvino.py --fp32 FP32_ARTIFACT --int8 INT8_ARTIFACT --queries HELDOUT.txt
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def batches_of(tokenizer_path: Path, queries: list[str], batch: int) -> list[dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.enable_padding(pad_id=0)
    queries = sorted(queries, key=lambda s: len(tok.encode(s).ids))
    out = []
    for i in range(0, len(queries), batch):
        enc = tok.encode_batch(queries[i:i + batch])
        ids = np.array([e.ids for e in enc], np.int64)
        out.append({"input_ids": ids, "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
                    "token_type_ids": np.zeros_like(ids)})
    return out


def pooled(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    v = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def engines(fp32: Path, int8: Path, tmp: Path) -> dict:
    import nncf
    import onnxruntime as ort
    import openvino as ov

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    out = {}
    for name, art in (("onnxruntime fp32", fp32), ("onnxruntime int8 (artifact)", int8)):
        s = ort.InferenceSession(str(art / "model.onnx"), so, providers=["CPUExecutionProvider"])
        out[name] = lambda b, s=s: s.run(None, b)[0]
    # through IR files: NNCF cannot walk the graph of a model read straight from ONNX (node names)
    ov.save_model(ov.convert_model(str(fp32 / "model.onnx")), str(tmp / "fp32.xml"), compress_to_fp16=False)
    core = ov.Core()
    compressed = nncf.compress_weights(core.read_model(str(tmp / "fp32.xml")), mode=nncf.CompressWeightsMode.INT8_SYM)
    ov.save_model(compressed, str(tmp / "int8w.xml"), compress_to_fp16=False)
    cfg = {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32", "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
    variants = [("openvino fp32", "fp32.xml", {}),
                ("openvino int8 weights, activations per 32", "int8w.xml", {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 32}),
                ("openvino int8 weights, activations per row", "int8w.xml",
                 {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0xFFFFFFFF}),
                ("openvino int8 weights, FP32 activations", "int8w.xml", {"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0})]
    for name, xml, extra in variants:
        req = core.compile_model(core.read_model(str(tmp / xml)), "CPU", {**cfg, **extra}).create_infer_request()
        out[name] = lambda b, req=req: next(iter(req.infer(b).values()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp32", type=Path, required=True)
    ap.add_argument("--int8", type=Path, required=True)
    ap.add_argument("--queries", type=Path, required=True, help="one query a line (the held-out corpus)")
    ap.add_argument("--limit", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    queries = [q.strip() for q in args.queries.read_text().splitlines() if q.strip()][: args.limit]
    batches = batches_of(args.fp32 / "tokenizer.json", queries, args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        eng = engines(args.fp32, args.int8, Path(tmp))
        ref = [pooled(eng["onnxruntime fp32"](b), b["attention_mask"]) for b in batches]
        rows = {}
        for name, run in eng.items():
            cos = np.concatenate([(pooled(run(b), b["attention_mask"]) * r).sum(1) for b, r in zip(batches, ref)])
            rows[name] = {"min_cos": float(cos.min()), "mean_cos": float(cos.mean()), "ms": []}
        for r in range(args.rounds):  # interleaved: each round times every engine once
            for name, run in eng.items():
                t = time.perf_counter()
                for b in batches:
                    run(b)
                rows[name]["ms"].append(1e3 * (time.perf_counter() - t) / len(queries))
            print(f"round {r + 1}/{args.rounds}", flush=True)
    base = statistics.median(rows["onnxruntime fp32"]["ms"])
    print(f"\n{len(queries)} held-out queries, batches of {args.batch} (length-sorted), one thread, median of "
          f"{args.rounds} interleaved rounds\n")
    print("| engine | ms a query | x ONNX Runtime FP32 | min cosine | mean cosine |\n| --- | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        r["median_ms"] = statistics.median(r["ms"])
        print(f"| {name} | {r['median_ms']:.3f} | {base / r['median_ms']:.2f}x | {r['min_cos']:.5f} | {r['mean_cos']:.5f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

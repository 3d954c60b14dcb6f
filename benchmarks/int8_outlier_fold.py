"""Could the INT8 artifact's outlier channels ride inside the int8 product instead of an FP32 Gemm? Product error of
each quantized node on real calibration activations against the FP32 product: the outlier split (the artifact's:
4 channels a node in FP32, a K=4 Gemm over the whole [T, N] output) against folding them into the int8 product as
M scaled copies (a Gather to [T, K + sum M], each copy x_c * a_c with a_c putting it at the 10th percentile of the
row's other maximum, the copies' int8 weights summing to round(w_c / (a_c * t_n)): M times the weight precision of
one copy, so only the activation's own 8 bits remain). The fold would remove the [T, N] Gemm pass of the QKV and
FFN-in nodes (14% of the INT8 run at 32-query batches on session 11's VM); measured in
docs/benchmarks/optimizer.md, issue 21, session 11.

    PYTHONPATH=src python3 benchmarks/int8_outlier_fold.py ART   # ART/int8, ART/fp32: `surge optimize` outputs

Only the FFN-in rows compare against a right reference (the attention rows' FP32 weights are laid out differently:
read their split-vs-fold difference only)."""
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper as nh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from surge.optimize.smooth import probe_inputs
from surge.data import calibration_queries
from surge.models import load_model_spec
from surge.optimize.validate import encode_texts
from surge.types import TokenBatch
ART = sys.argv[1] if len(sys.argv) > 1 else "/tmp/s11/art"
i8 = onnx.load(f"{ART}/int8/model.onnx"); f32 = onnx.load(f"{ART}/fp32/model.onnx")
I = {i.name: i for i in i8.graph.initializer}; F = {i.name: i for i in f32.graph.initializer}
A = lambda d, n: nh.to_array(d[n]).astype(np.float64)
spec = load_model_spec(f"{ART}/fp32")
items = sorted(encode_texts(spec, calibration_queries()[:256]), key=len)
batches = [TokenBatch.pad(items[i:i+32], pad_id=spec.pad_token_id) for i in range(0, len(items), 32)]
nodes = {}
for n in i8.graph.node:
    if n.op_type == "Gather" and n.name.startswith("rowq/") and n.input[1].endswith("/outl"):
        p = n.name.rsplit("/", 1)[0]
        nodes[p] = {"x": n.input[0]}
for n in i8.graph.node:
    for p, d in nodes.items():
        if n.op_type == "Mul" and n.input[0] == d["x"] and n.input[1] in I and I[n.input[1]].dims == [I[p + "/wq"].dims[0]]:
            d["inv"] = n.input[1]
        if n.name == p + "/0" and n.op_type == "Mul":
            d["inv"] = n.input[1]
# fp32 weights by position: QKV of layer k is Attention_k, others by MatMul name
def w32(p):
    name = p[len("rowq/"):]
    if name.startswith("Attention_"): return A(F, name + "_qkv_weight")
    mm = next(n for n in f32.graph.node if n.name == name); return A(F, mm.input[1])
want = sorted({d["x"] for d in nodes.values()})
X = {k: [] for k in want}
for b, vals in probe_inputs(i8, want, batches):
    m = b.attention_mask.astype(bool)
    for k, v in vals.items(): X[k].append(v[m])
X = {k: np.concatenate(v).astype(np.float64) for k, v in X.items()}
def q_rows(x):
    s = np.maximum(np.abs(x).max(1, keepdims=True), 1e-8) / 127
    return np.clip(np.round(x / s), -127, 127), s
print(f"{'node':55s} {'K->N':>10s} {'split':>8s} {'kext':>8s} {'M':>12s}  (relative error of the product vs FP32)")
for p, d in sorted(nodes.items()):
    x = X[d["x"]]; W = w32(p); wq = A(I, p + "/wq"); ws = A(I, p + "/ws"); wo = A(I, p + "/w_out"); outl = nh.to_array(I[p + "/outl"])
    inv = A(I, d["inv"]) if "inv" in d else np.ones(x.shape[1]) 
    mask = np.ones(x.shape[1]); mask[outl] = 0
    inv_m = inv * mask
    if "output/dense" in p and "attention" not in p:
        continue  # GELU-fed (unsigned, shifted) nodes: not a K-extension candidate (K > N)
    y32 = x @ W
    xm = x * inv_m
    qa, s = q_rows(xm)
    y_main = (qa @ wq) * s * ws
    y_split = y_main + x[:, outl] @ wo
    e = lambda y: np.linalg.norm(y - y32) / np.linalg.norm(y32)
    # K-extension: copies v = x_c * a_c, a_c so that |v| <= p90 of the row max of the main part
    rowmax = np.abs(xm).max(1)
    cols, rows = [], []
    Ms = []
    for j, c in enumerate(outl):
        ratio = np.percentile(rowmax / np.maximum(np.abs(x[:, c]), 1e-9), 10)
        a = ratio
        Q = np.round(wo[j] / (a * ws))              # integer weight total per column
        M = int(np.ceil(np.abs(Q).max() / 127)); Ms.append(M)
        base = np.trunc(Q / M); rem = Q - base * M   # distribute Q over M copies, |q| <= 127
        for i in range(M):
            rows.append(base + (np.sign(rem) * (i < np.abs(rem))))
            cols.append(x[:, c] * a)
    xe = np.concatenate([xm, np.stack(cols, 1)], 1)
    qe, se = q_rows(xe)
    we = np.concatenate([wq, np.stack(rows)], 0)
    y_k = (qe @ we) * se * ws
    print(f"{p[-55:]:55s} {x.shape[1]:4d}->{W.shape[1]:<5d} {e(y_split):8.5f} {e(y_k):8.5f} {str(Ms):>12s}")

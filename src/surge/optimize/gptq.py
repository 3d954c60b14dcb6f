"""INT8 weights rounded with error feedback (GPTQ), for the per-row INT8 path (rowquant.py).

Rounding each weight to its nearest int8 code leaves an error that the layer's
output carries for every token along the same input directions, so it does not
average out when a sentence's tokens are pooled. GPTQ (Frantar et al., 2023,
"GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers") rounds one input row of W at a time and pushes that row's
rounding error onto the rows not yet rounded, weighted by the inverse of the
inputs' second moment H = E[x x^T] (measured on the calibration sentences'
real tokens), so that x @ W_q stays close to x @ W for the inputs the layer
actually sees. The scales stay per output channel (absmax / 127, as plain
rounding), so the int8 codes drop into the same MatMulIntegerToFloat graph.

Measured on the bundled MiniLM (held-out queries, SmoothQuant alpha 0.65,
per-row activations): mean cosine to FP32 0.99885 -> 0.99920, worst
sentence 0.989 -> 0.994 (docs/benchmarks/optimizer.md, Issue 21, session 2).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from surge.blas_threads import one_blas_thread


def input_moments(model: onnx.ModelProto, batches, inputs: set[str], threads: int = 0) -> dict[str, np.ndarray]:
    """E[x x^T] [K, K] of each named tensor over the real tokens of the batches (float64)."""
    from surge.optimize.validate import session

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    present = {o.name for o in probe.graph.output}
    for name in sorted(inputs - present):
        probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    sess = session(probe.SerializeToString(), threads)
    names = [o.name for o in sess.get_outputs()]
    feeds_in = {i.name for i in sess.get_inputs()}
    sums: dict[str, np.ndarray] = {}
    count: dict[str, int] = {}
    for b in batches:
        feeds = {"input_ids": b.input_ids, "attention_mask": b.attention_mask, "token_type_ids": b.token_type_ids}
        real = b.attention_mask.astype(bool)
        for name, value in zip(names, sess.run(None, {k: v for k, v in feeds.items() if k in feeds_in})):
            if name not in inputs:
                continue
            # Padding rows carry no meaning: the moments are over real tokens only.
            x = (value[real] if value.ndim == 3 and value.shape[:2] == real.shape else value.reshape(-1, value.shape[-1]))
            x = x.astype(np.float64)
            sums[name] = sums.get(name, 0.0) + x.T @ x
            count[name] = count.get(name, 0) + len(x)
    return {k: sums[k] / max(count[k], 1) for k in sums}


def feedback_factor(h: np.ndarray) -> np.ndarray:
    """The upper triangular U with U^T U = H^-1 (the Cholesky factor of the inverse, transposed), for a
    symmetric positive definite H, without forming H^-1.

    H's rows and columns reversed have a lower Cholesky factor L; reversed back it is an upper V with
    H = V V^T, so H^-1 = V^-T V^-1 and U = V^-1, one triangular inverse. A general inverse (LU) and a
    second factorization took 2.5x as long at K = 1536 (benchmarks/int8_search_cpu.py)."""
    from scipy.linalg import lapack

    v = np.linalg.cholesky(h[::-1, ::-1])[::-1, ::-1]
    u, info = lapack.dtrtri(np.asfortranarray(v), lower=0)
    if info != 0:
        raise np.linalg.LinAlgError(f"triangular inverse failed (LAPACK info {info})")
    return np.triu(u)


def gptq_int8(w: np.ndarray, h: np.ndarray, damp: float = 0.01, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes [K, N] and per-column scales [N] of W [K, N] (y = x @ W), given H = E[x x^T] [K, K].

    Rows are rounded in blocks of `block`: inside a block the feedback is applied row by row, to the
    rows after it the block's errors go in one matrix product (the paper's lazy batch updates). numpy's BLAS runs
    on one thread here: the row loop's many small products lose to OpenBLAS's spinning threads (surge/blas_threads.py)."""
    from scipy.linalg import lapack  # noqa: F401  (its BLAS loaded before the libraries are looked for)

    with one_blas_thread(fresh=True):
        return _gptq_int8(w, h, damp, block)


def _gptq_int8(w: np.ndarray, h: np.ndarray, damp: float, block: int) -> tuple[np.ndarray, np.ndarray]:
    w = w.astype(np.float64).copy()
    k = w.shape[0]
    scale = np.maximum(np.abs(w).max(0), 1e-12) / 127.0
    h = h.astype(np.float64).copy()
    dead = np.diag(h) <= 0  # an input channel that is always zero: its weights never matter
    h[dead, dead] = 1.0
    w[dead, :] = 0.0
    h += damp * float(np.mean(np.diag(h))) * np.eye(k)  # dampening keeps the inverse well conditioned
    u = feedback_factor(h)  # upper triangular: row i's feedback onto rows > i
    q = np.empty(w.shape, np.int8)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        part = w[b0:b1].copy()
        errs = np.empty_like(part)
        for i in range(b1 - b0):
            row = np.clip(np.round(part[i] / scale), -127, 127)
            q[b0 + i] = row
            errs[i] = (part[i] - row * scale) / u[b0 + i, b0 + i]
            part[i + 1:] -= np.outer(u[b0 + i, b0 + i + 1 : b1], errs[i])
        w[b1:] -= u[b0:b1, b1:].T @ errs
    return q, scale.astype(np.float32)


def node_moments(model: onnx.ModelProto, batches, threads: int = 0) -> dict[str, np.ndarray]:
    """input_moments of every input that quantize_rows converts a node on (what gptq_weights reads)."""
    from surge.optimize.rowquant import quantizable

    return input_moments(model, batches, {n.input[0] for n in quantizable(model) if n.name}, threads)


def gptq_weights(model: onnx.ModelProto, batches, threads: int = 0, damp: float = 0.01,
                 outliers: dict[str, np.ndarray] | None = None, moments: dict[str, np.ndarray] | None = None) -> dict:
    """node name -> (int8 codes, scales) for every node quantize_rows converts, from the calibration batches.
    `outliers`: node name -> input channels that quantize_rows takes out of the int8 product (computed in
    FP32): their weight rows and their inputs' moments are zero here, so no error is pushed onto them.
    `moments`: node_moments(model, batches) when the caller has them already (a pass over the batches
    saved; they are not modified), else measured here."""
    from onnx import numpy_helper as nh

    from surge.optimize.rowquant import quantizable

    nodes = [n for n in quantizable(model) if n.name]
    inits = {i.name: i for i in model.graph.initializer}
    if moments is None:
        moments = node_moments(model, batches, threads)
    out = {}
    for n in nodes:
        if n.input[0] not in moments:
            continue
        w, h = nh.to_array(inits[n.input[1]]), moments[n.input[0]]
        split = outliers.get(n.name) if outliers else None
        if split is not None and len(split):
            w, h = w.copy(), h.copy()
            w[split] = 0.0
            h[split, :] = 0.0
            h[:, split] = 0.0
        out[n.name] = gptq_int8(w, h, damp)
    return out

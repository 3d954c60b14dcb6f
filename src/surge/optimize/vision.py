"""The optimizer on vision (CNN) graphs: Conv + BatchNorm folding, Conv + Add + ReLU
fusion, FP16 with a block list, static INT8 (QDQ, calibrated on sample inputs),
each candidate kept only if it passes the accuracy gate on top-1 agreement.

Passes work on the ONNX protobuf with numpy (the patterns are three ops long;
the graph is walked once per pass):

- fold_batchnorm: Conv -> BatchNormalization (constant statistics, the Conv's
  only consumer) becomes one Conv with W' = W * g / sqrt(v + eps) per output
  channel and b' = (b - m) * g / sqrt(v + eps) + beta.
- fuse_conv_add_relu: Conv -> Add(other) -> Relu becomes ONNX Runtime's
  com.microsoft FusedConv with the residual as its `Z` (sum) input and
  activation Relu, one kernel with the add and ReLU in its epilogue; a Conv ->
  Relu becomes FusedConv too.
- FP16 reuses optimize/precision.py's converter (block-listed op types stay FP32).
- INT8 is onnxruntime.quantization's static QDQ quantizer (per-channel S8 weights,
  U8 activations calibrated on the sample inputs), run on the folded graph.

The gate: the candidate's top-1 class must agree with the FP32 reference's on at
least `min_top1_agreement` of the sample inputs (and with a labelled set, its
accuracy may not drop by more than `max_accuracy_drop`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

VISION_BLOCK_LIST = ["Softmax", "ReduceMean", "GlobalAveragePool", "BatchNormalization"]


def _consumers(graph) -> dict[str, list]:
    uses: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            uses.setdefault(name, []).append(node)
    for out in graph.output:
        uses.setdefault(out.name, []).append(None)  # a graph output is a use
    return uses


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def fold_batchnorm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Conv + BatchNormalization -> Conv; returns the new model and how many were folded."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    uses = _consumers(g)
    drop, folded = set(), 0
    for bn in g.node:
        if bn.op_type != "BatchNormalization" or len(bn.output) != 1 and any(bn.output[1:]):
            continue
        conv = producer.get(bn.input[0])
        if conv is None or conv.op_type != "Conv" or len(uses.get(conv.output[0], [])) != 1:
            continue
        names = list(bn.input[1:5])
        if not all(n in inits for n in names) or conv.input[1] not in inits:
            continue
        gamma, beta, mean, var = (numpy_helper.to_array(inits[n]).astype(np.float64) for n in names)
        eps = _attr(bn, "epsilon", 1e-5)
        w = numpy_helper.to_array(inits[conv.input[1]]).astype(np.float64)
        b = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if len(conv.input) > 2 and conv.input[2] \
            else np.zeros(w.shape[0])
        scale = gamma / np.sqrt(var + eps)
        w_name, b_name = f"{conv.name or conv.output[0]}_W_folded", f"{conv.name or conv.output[0]}_B_folded"
        g.initializer.append(numpy_helper.from_array((w * scale[:, None, None, None]).astype(np.float32), w_name))
        g.initializer.append(numpy_helper.from_array(((b - mean) * scale + beta).astype(np.float32), b_name))
        del conv.input[1:]
        conv.input.extend([w_name, b_name])
        conv.output[0] = bn.output[0]
        drop.add(id(bn))
        folded += 1
    kept = [n for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(kept)
    return _prune_initializers(model), folded


def fuse_conv_add_relu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Conv [+ Add(residual)] + Relu -> com.microsoft FusedConv; returns the model and the count."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    uses = _consumers(g)
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    fused = 0
    for relu in g.node:
        if relu.op_type != "Relu":
            continue
        src = producer.get(relu.input[0])
        residual = None
        if src is not None and src.op_type == "Add" and len(uses.get(src.output[0], [])) == 1:
            a, b = (producer.get(i) for i in src.input)
            for conv_node, other in ((a, src.input[1]), (b, src.input[0])):
                if conv_node is not None and conv_node.op_type == "Conv" and \
                        len(uses.get(conv_node.output[0], [])) == 1 and id(conv_node) not in drop:
                    conv, residual, add = conv_node, other, src
                    break
            else:
                continue
        elif src is not None and src.op_type == "Conv" and len(uses.get(src.output[0], [])) == 1:
            conv, add = src, None
        else:
            continue
        inputs = list(conv.input) + [""] * (3 - len(conv.input))
        if residual is not None:
            inputs.append(residual)
        node = helper.make_node("FusedConv", inputs, [relu.output[0]], name=f"{conv.name}_fused",
                                domain="com.microsoft", activation="Relu")
        node.attribute.extend(a for a in conv.attribute)
        replace[id(conv)] = node
        drop.add(id(relu))
        if add is not None:
            drop.add(id(add))
        fused += 1
    nodes = [replace.get(id(n), n) for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(nodes)
    if fused and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model, fused


def _prune_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model


def to_fp16(model: onnx.ModelProto, block_list: list[str] | None = None) -> onnx.ModelProto:
    from surge.optimize.precision import convert

    return convert(model, "fp16", VISION_BLOCK_LIST if block_list is None else block_list)


def quantize_int8(model: onnx.ModelProto, samples: dict[str, np.ndarray], work_dir: Path,
                  per_channel: bool = True, batch: int = 16) -> onnx.ModelProto:
    """Static INT8 in QDQ form, activations calibrated (MinMax) on `samples` (name -> [N, ...])."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            n = len(next(iter(samples.values())))
            self.batches = iter([{k: v[i:i + batch] for k, v in samples.items()} for i in range(0, n, batch)])

        def get_next(self):
            return next(self.batches, None)

    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    src, pre, out = work_dir / "fp32.onnx", work_dir / "fp32_pre.onnx", work_dir / "int8.onnx"
    onnx.save(model, str(src))
    try:
        quant_pre_process(str(src), str(pre), skip_symbolic_shape=True)
    except Exception:  # noqa: BLE001 - pre-processing is an optimization; quantize the graph as it is
        pre = src
    # U8 activations x S8 weights: ONNX Runtime's x86 QLinearConv kernels (VNNI / AMX) take this pair;
    # with S8 activations the same graph ran no faster than FP32 here (benchmarks/generic_models.py).
    quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=per_channel,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                    extra_options={"ActivationSymmetric": False, "WeightSymmetric": True})
    return onnx.load(str(out))


# ---- the gate ----------------------------------------------------------------------
def run(model: onnx.ModelProto | str | Path, inputs: dict[str, np.ndarray], threads: int = 0,
        batch: int = 64) -> np.ndarray:
    from surge.optimize.validate import session

    sess = session(model.SerializeToString() if isinstance(model, onnx.ModelProto) else model, threads)
    n = len(next(iter(inputs.values())))
    return np.concatenate([sess.run(None, {k: v[i:i + batch] for k, v in inputs.items()})[0]
                           for i in range(0, n, batch)])


@dataclass
class Candidate:
    name: str
    model: onnx.ModelProto | None
    top1_agreement: float = 0.0
    accuracy: float | None = None
    passed: bool = False
    note: str = ""


@dataclass
class VisionReport:
    reference_accuracy: float | None
    candidates: list[Candidate] = field(default_factory=list)
    folded: int = 0
    fused: int = 0

    def best(self, name: str) -> Candidate | None:
        return next((c for c in self.candidates if c.name == name and c.passed), None)


def gate(reference: np.ndarray, candidate: np.ndarray, labels: np.ndarray | None, min_agreement: float,
         max_accuracy_drop: float) -> tuple[float, float | None, bool]:
    agree = float((reference.argmax(1) == candidate.argmax(1)).mean())
    if labels is None:
        return agree, None, agree >= min_agreement
    ref_acc = float((reference.argmax(1) == labels).mean())
    acc = float((candidate.argmax(1) == labels).mean())
    return agree, acc, agree >= min_agreement and ref_acc - acc <= max_accuracy_drop


def optimize_vision(model: onnx.ModelProto, calibration: dict[str, np.ndarray], validation: dict[str, np.ndarray],
                    work_dir: Path, *, labels: np.ndarray | None = None, precisions=("fp32", "fp16", "int8"),
                    min_top1_agreement: float = 0.97, max_accuracy_drop: float = 0.02,
                    fp16_block_list: list[str] | None = None, threads: int = 0) -> VisionReport:
    """Every precision's candidate, each checked by the gate against the raw graph's FP32 outputs on `validation`."""
    reference = run(model, validation, threads)
    report = VisionReport(float((reference.argmax(1) == labels).mean()) if labels is not None else None)
    folded, report.folded = fold_batchnorm(model)
    fused, report.fused = fuse_conv_add_relu(folded)
    builders = {
        "fp32": lambda: fused,
        # FP16 and INT8 start from the folded graph: FusedConv has no FP16 CPU kernel and the
        # quantizer works on standard ops (ORT fuses the QDQ graph's Conv + Relu itself).
        "fp16": lambda: to_fp16(folded, fp16_block_list),
        "int8": lambda: quantize_int8(folded, calibration, Path(work_dir) / "int8"),
    }
    for name in precisions:
        try:
            cand = builders[name]()
            out = run(cand, validation, threads).astype(np.float32)
        except Exception as exc:  # noqa: BLE001 - a failed candidate is reported, not fatal
            report.candidates.append(Candidate(name, None, note=f"{type(exc).__name__}: {exc}"))
            continue
        agree, acc, ok = gate(reference, out, labels, min_top1_agreement, max_accuracy_drop)
        report.candidates.append(Candidate(name, cand, agree, acc, ok,
                                           "" if ok else f"gate: top-1 agreement {agree:.3f} < {min_top1_agreement}"
                                           if agree < min_top1_agreement else "gate: accuracy dropped"))
    return report


def save_candidate(report: VisionReport, name: str, version_dir: Path, max_batch_size: int = 32) -> Path:
    """Write a gated candidate as a repository version: model.onnx, model.yaml (kind onnx), manifest.json.

    Only a candidate that passed the gate is written (ValueError otherwise), so a
    repository never serves a graph that failed its accuracy check."""
    import json

    cand = report.best(name)
    if cand is None:
        tried = next((c for c in report.candidates if c.name == name), None)
        raise ValueError(f"no {name} candidate passed the gate" + (f": {tried.note}" if tried else ""))
    version_dir = Path(version_dir)
    version_dir.mkdir(parents=True, exist_ok=True)
    onnx.save(cand.model, str(version_dir / "model.onnx"))
    (version_dir / "model.yaml").write_text(
        f"kind: onnx\ndescription: surge optimize (vision) {name}, top-1 agreement {cand.top1_agreement:.4f}\n"
        f"tensor: {{max_batch_size: {max_batch_size}}}\n")
    manifest = {"precision": name, "top1_agreement": cand.top1_agreement, "accuracy": cand.accuracy,
                "reference_accuracy": report.reference_accuracy, "batchnorm_folded": report.folded,
                "convs_fused": report.fused, "model_file": "model.onnx"}
    (version_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return version_dir

"""Running one of onnxruntime.transformers' BERT fusions on an onnx-ir model.

onnxscript's rewriter has no fusion for the mask / attention shapes the
TorchScript exporter writes for BERT; ONNX Runtime's own fusions (the ones
behind `onnxruntime.transformers.optimizer`) do, so the fusion passes borrow
them one at a time. The model crosses to a ModelProto and back; the fused ops
are ONNX Runtime contrib ops (domain com.microsoft).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import onnx_ir as ir


def run_ort_fusions(model: ir.Model, steps: Callable[[object], None]) -> ir.Model:
    """Serialize, call `steps(onnx_model_bert)`, prune, and return the new ir model."""
    from onnxruntime.transformers.onnx_model_bert import BertOnnxModel

    # ORT's fusions log at INFO and warn about things that are normal for us.
    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    for name in ("fusion_base", "fusion_attention", "onnx_model", "fusion_utils", "fusion_skiplayernorm",
                 "fusion_embedlayer", "fusion_biasgelu", "fusion_gelu", "onnx_model_bert", "fusion_options"):
        logging.getLogger(name).setLevel(logging.ERROR)
    proto = ir.serde.serialize_model(model)
    bert = BertOnnxModel(proto)
    steps(bert)
    bert.prune_graph()
    new = ir.serde.deserialize_model(bert.model)
    # ORT's fusions add contrib nodes without importing their domain (ORT's
    # own save adds it later); onnx's checker and shape inference need it.
    if any(n.domain == "com.microsoft" for n in new.graph):
        new.opset_imports.setdefault("com.microsoft", 1)
    return new


def replace_in_place(model: ir.Model, new: ir.Model) -> None:
    """Make `model` hold `new`'s graph (passes change their argument in place)."""
    model.graph = new.graph  # the opset imports live on the graph
    model.functions.clear()
    model.functions.update(new.functions)


def fused_count(new: ir.Model, op_type: str) -> int:
    return sum(1 for n in new.graph if n.op_type == op_type)

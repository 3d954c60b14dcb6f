"""A tensor model (kinds onnx, torch, python) as a pipeline node: `model: NAME` in pipeline.yaml.

Its ports are the model's tensors: each input port takes one item's value
(a JSON number, list or string; the batch dimension is added here when the
model batches), each output port gives that item's tensor as a list; `version`
gives the model version that answered. The call goes through the model's
batcher and cache like any request, so concurrent pipeline requests share
batches.
"""

from __future__ import annotations

import numpy as np

from surge.config import PipelineNode
from surge.errors import InvalidInput
from surge.runtime.steps import LoadContext, Node
from surge.runtime.tensor_service import NUMPY_OF


def is_tensor_model(registry, spec: PipelineNode) -> bool:
    try:
        return getattr(registry.get(spec.model, spec.version), "task", "embed") == "tensor"
    except Exception:  # noqa: BLE001 - unknown models are reported by ModelNode
        return False


class TensorModelNode(Node):
    def __init__(self, spec: PipelineNode, ctx: LoadContext):
        super().__init__(spec, ctx)
        self.registry = ctx.registry
        cfg = ctx.registry.get(spec.model, spec.version).config
        text = lambda t: t.datatype == "BYTES" and (t.dims in ((), (1,)))  # noqa: E731
        self.inputs = {t.name: "text" if text(t) else "any" for t in cfg.inputs}
        self.optional = frozenset(t.name for t in cfg.inputs if t.optional)
        self.outputs = {**{t.name: "any" for t in cfg.outputs}, "version": "label"}
        self.shapes = {t.name: tuple(t.dims) for t in cfg.outputs}  # one item's dims (what `when` may test)
        if spec.params:
            raise ctx.error("params", f"a tensor model node takes no params, got {sorted(spec.params)}")

    async def __call__(self, args: dict) -> dict:
        service = self.registry.get(self.spec.model, self.spec.version)
        cfg = service.config
        arrays = {}
        for t in cfg.inputs:
            if args.get(t.name) is None:
                continue
            value = args[t.name]
            try:
                if t.datatype == "BYTES":
                    flat = np.asarray(value, dtype=object)
                    a = np.vectorize(lambda v: v.encode() if isinstance(v, str) else v, otypes=[object])(flat) \
                        if flat.size else flat
                    a = np.asarray(a, dtype=object).reshape(flat.shape)
                else:
                    a = np.asarray(value, dtype=NUMPY_OF[t.datatype])
            except (TypeError, ValueError) as exc:
                raise InvalidInput(f"node '{self.spec.name}': input '{t.name}' is not {t.datatype}: {exc}") from None
            if t.datatype == "BYTES" and t.dims == (1,) and a.ndim == 0:
                a = a.reshape(1)
            arrays[t.name] = a[None] if cfg.batched else a
        result = await service.infer(arrays)
        out = {name: (a[0] if cfg.batched else a) for name, a in result.outputs.items()}
        out = {k: ([x.decode("utf-8", "replace") for x in v.ravel()] if v.dtype == object else v) if
               isinstance(v, np.ndarray) else (v.decode("utf-8", "replace") if isinstance(v, bytes) else v)
               for k, v in out.items()}
        return {**out, "version": result.version}

"""A torch.export program (`.pt2`) as a tensor engine, on the CPU or a CUDA GPU.

Inputs are the program's user inputs (their placeholder names), outputs are
named `output__0`, `output__1`, ... (Triton's PyTorch convention) unless the
model.yaml names them; datatypes and shapes come from the exported graph
(a symbolic dim is -1).

On the GPU each batch bucket (powers of two up to max_batch_size) is captured
once as a CUDA graph at warm-up; a batch of n runs in the smallest bucket >= n
(rows past n hold the previous batch's data and are never read back: with the
model in eval mode rows do not mix). All buckets share one memory pool, largest
captured first, so the activations of every bucket live in the same memory
(reused between buckets rather than allocated per bucket) and the static input
and output buffers are the only per-bucket memory.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from surge.engines.graph_capture import capture
from surge.errors import EngineError, InvalidInput

_DATATYPES = {"torch.float32": "FP32", "torch.float16": "FP16", "torch.float64": "FP64", "torch.int64": "INT64",
              "torch.int32": "INT32", "torch.int16": "INT16", "torch.int8": "INT8", "torch.uint8": "UINT8",
              "torch.bool": "BOOL"}


def _shape(val) -> tuple[int, ...]:
    return tuple(int(d) if isinstance(d, int) or str(d).isdigit() else -1 for d in val.shape)


class TorchTensorEngine:
    def __init__(self, device: str = "cpu", precision: str = "fp32", output_names: list[str] | None = None,
                 cuda_graphs: bool = True):
        self.device = device
        self.precision = precision
        self.output_names = output_names
        self.cuda_graphs = cuda_graphs and device.startswith("cuda")
        self.inputs: list[tuple[str, str, tuple[int, ...]]] = []
        self.outputs: list[tuple[str, str, tuple[int, ...]]] = []
        self.module = None
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, static inputs, static outputs)
        self._lock = threading.Lock()

    def load(self, path: Path) -> None:
        import torch

        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineError(f"device '{self.device}' asked for, but this torch build sees no CUDA GPU")
        try:
            program = torch.export.load(str(path))
        except Exception as exc:  # not a .pt2, or written by an incompatible torch
            raise EngineError(f"cannot load {Path(path).name}: {type(exc).__name__}: "
                              f"{str(exc).strip().splitlines()[-1][:300] if str(exc) else ''}") from None
        sig = program.graph_signature
        nodes = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        for name in sig.user_inputs:
            val = nodes[name].meta.get("val")
            if val is None or not hasattr(val, "dtype"):
                raise EngineError(f"input '{name}' of {Path(path).name} is not a tensor")
            self.inputs.append((name, _DATATYPES.get(str(val.dtype), "FP32"), _shape(val)))
        out_node = next(n for n in program.graph.nodes if n.op == "output")
        vals = [a.meta.get("val") for a in out_node.args[0]][-len(sig.user_outputs):]
        names = self.output_names or [f"output__{i}" for i in range(len(vals))]
        if len(names) != len(vals):
            raise EngineError(f"{Path(path).name} has {len(vals)} outputs, the config names {len(names)}")
        for name, val in zip(names, vals):
            self.outputs.append((name, _DATATYPES.get(str(val.dtype), "FP32"), _shape(val)))
        module = program.module()
        self.half = self.precision == "fp16"
        if self.half:
            module = module.half()
        self.module = module.to(self.device)
        self.torch = torch

    # ---- running ------------------------------------------------------------------
    def _to_device(self, feeds: dict[str, np.ndarray]) -> list:
        torch = self.torch
        args = []
        for name, _, _ in self.inputs:
            t = torch.from_numpy(np.ascontiguousarray(feeds[name])).to(self.device, non_blocking=True)
            if self.half and t.is_floating_point():
                t = t.half()
            args.append(t)
        return args

    def _eager(self, args: list) -> list:
        with self.torch.inference_mode():
            out = self.module(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _to_numpy(self, outs: list, n: int | None) -> dict[str, np.ndarray]:
        result = {}
        for (name, dt, _), t in zip(self.outputs, outs):
            t = t[:n] if n is not None else t
            if self.half and dt == "FP32":
                t = t.float()
            result[name] = t.detach().to("cpu").numpy().copy()
        return result

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            with self.torch.inference_mode():  # the CUDA graphs' static buffers are inference tensors
                return self._run(feeds)
        except (RuntimeError, ValueError) as exc:
            msg = str(exc).strip().splitlines()[0][:300] if str(exc) else type(exc).__name__
            # Guard failures of the exported program are shapes it was not exported for: the client's error.
            if "guard" in msg.lower() or "shape" in msg.lower() or "size" in msg.lower():
                raise InvalidInput(f"the model rejected the inputs: {msg}") from None
            raise EngineError(f"inference failed: {msg}") from None

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = self._to_device(feeds)
        n = args[0].shape[0] if args and args[0].dim() else None
        bucket = self._bucket(n) if self.graphs and n is not None else None
        if bucket is None:
            return self._to_numpy(self._eager(args), None)
        with self._lock:
            graph, static_in, static_out = self.graphs[bucket]
            for s, a in zip(static_in, args):
                s[:n].copy_(a)
            graph.replay()
            return self._to_numpy(static_out, n)

    def _bucket(self, n: int) -> int | None:
        for b in sorted(self.graphs):
            if b >= n:
                return b
        return None

    def warmup(self, max_batch: int) -> None:
        """Run once; on the GPU, capture one CUDA graph per batch bucket (largest first, one pool)."""
        torch = self.torch
        static = all(all(d != -1 for d in shape[1:]) for _, _, shape in self.inputs)
        if not (self.cuda_graphs and max_batch > 0 and static):
            feeds = {name: _example(dt, shape, 1 if max_batch else None) for name, dt, shape in self.inputs}
            self.run(feeds)
            return
        buckets, b = [], 1
        while b < max_batch:
            buckets.append(b)
            b *= 2
        buckets.append(max_batch)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in sorted(buckets, reverse=True):
                static_in = self._to_device({name: _example(dt, shape, b) for name, dt, shape in self.inputs})
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._eager(static_in)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with capture(graph, pool=pool):
                    static_out = self._eager(static_in)
                self.graphs[b] = (graph, static_in, static_out)
        torch.cuda.current_stream().synchronize()  # not the device's: engines/graph_capture.py

    def close(self) -> None:
        self.graphs.clear()
        self.module = None


def _example(datatype: str, shape: tuple[int, ...], batch: int | None) -> np.ndarray:
    dims = list(shape)
    if batch is not None and dims:
        dims[0] = batch
    dims = [d if d > 0 else 1 for d in dims]
    rng = np.random.default_rng(0)
    if datatype.startswith(("INT", "UINT")):
        return rng.integers(0, 2, size=dims).astype({"INT64": np.int64, "INT32": np.int32}.get(datatype, np.int64))
    if datatype == "BOOL":
        return rng.integers(0, 2, size=dims).astype(bool)
    return rng.standard_normal(dims).astype(np.float16 if datatype == "FP16" else np.float32)

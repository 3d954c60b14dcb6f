"""ONNX Runtime CPU engine.

Padded layout: the graph wants [B, L] ids, mask and token types. Inputs the
graph does not declare (an optimized graph may drop token_type_ids) are not fed.

A task model's graph (optimize/export.py) keeps its head and returns `logits`
([B, labels], or [B, L, labels] for a token head): `attach_heads` takes the
model's one head and `run_heads` hands back its rows (engines/heads.HeadSet
layout) with no host-side head. A backbone graph (hidden states) runs the heads
after the engine, as several heads on one backbone do.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort

from surge.engines.base import Capabilities, random_batch
from surge.engines.int8_weights import prepared
from surge.errors import EngineError
from surge.types import Layout, TokenBatch


class OnnxRuntimeEngine:
    def __init__(self, threads: int = 0, max_batch: int = 256, inter_op_threads: int = 1):
        self.threads = threads
        self.inter_op_threads = inter_op_threads
        self.max_batch = max_batch
        self.session: ort.InferenceSession | None = None
        self.head_set = None  # engines/heads.HeadSet whose one head the graph computes (attach_heads)
        self.logits = False  # the graph returns a task head's logits, not hidden states
        self.capabilities: Capabilities | None = None
        self._lock = threading.Lock()

    def load(self, artifact: Path) -> None:
        artifact = Path(artifact)
        manifest = json.loads((artifact / "manifest.json").read_text())
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads:
            opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = self.inter_op_threads
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # Spinning threads burn the cores that tokenization and the event loop
        # need between batches; serving prefers them parked.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        model_file = artifact / manifest.get("model_file", "model.onnx")
        # optimizers the artifact was measured without (optimize/skip_split.py), so ORT does not undo it
        disabled = list(manifest.get("ort_disabled_optimizers", []))
        try:
            self.session = ort.InferenceSession(prepared(model_file), opts, providers=["CPUExecutionProvider"],
                                                **({"disabled_optimizers": disabled} if disabled else {}))
        except Exception as exc:  # onnxruntime raises its own opaque types
            raise EngineError(f"cannot load {model_file}: {exc}") from exc
        self._inputs = {i.name for i in self.session.get_inputs()}
        self._output = self.session.get_outputs()[0].name
        out_type = self.session.get_outputs()[0].type
        self.logits = self._output == "logits"
        self._out_shape = self.session.get_outputs()[0].shape
        self.capabilities = Capabilities(
            max_batch=self.max_batch,
            max_tokens=int(manifest.get("max_length", 512)),
            layout=Layout.PADDED,
            device="cpu",
            dtype="fp16" if "float16" in out_type else "fp32",
            hidden_size=int(manifest.get("hidden_size", 0)),
        )
        self._vocab = int(manifest.get("vocab_size", 30522))

    def warmup(self, shapes: list[tuple[int, int]]) -> None:
        for b, s in shapes:
            self.run(random_batch(b, s, min(self._vocab, 30522)))

    def attach_heads(self, head_set) -> bool:
        """Take `head_set` as the graph's own head (a task graph and one matching head), else False."""
        if not self.logits:
            return False
        from surge.engines.heads import POOLED, TOKEN
        from surge.errors import ConfigError

        heads = head_set.heads
        width = self._out_shape[-1]
        token_graph = len(self._out_shape) == 3
        if len(heads) != 1 or heads[0].kind == POOLED or (heads[0].kind == TOKEN) != token_graph or (
                isinstance(width, int) and width != heads[0].width):
            raise ConfigError(f"this ONNX graph computes one {'token' if token_graph else 'sequence'} head "
                              f"with {width} outputs; it cannot serve the heads {[h.name for h in heads]} "
                              f"(several heads need the backbone graph)")
        self.head_set = head_set
        return True

    def run_heads(self, batch: TokenBatch) -> np.ndarray:
        """The attached head's rows: [B, labels], or per input its [n, labels] token logits flattened."""
        logits = self.run(batch).astype(np.float32, copy=False)
        if logits.ndim == 2:
            return np.ascontiguousarray(logits)
        tokens = logits[batch.attention_mask.astype(bool)]  # [T, labels], sequences in order
        return self.head_set.rows(np.zeros((batch.size, 0), np.float32), tokens, batch.lengths)

    def run(self, batch: TokenBatch) -> np.ndarray:
        if self.session is None:
            raise EngineError("engine not loaded")
        if batch.layout is not Layout.PADDED:
            raise EngineError("the ONNX Runtime engine takes padded batches")
        feeds = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = batch.token_type_ids
        try:
            (out,) = self.session.run([self._output], feeds)
        except Exception as exc:
            raise EngineError(f"onnxruntime failed on a [{batch.input_ids.shape}] batch: {exc}") from exc
        return out

    def close(self) -> None:
        self.session = None

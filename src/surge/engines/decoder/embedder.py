"""A decoder served as an embedding model (Qwen3-Embedding, e5-mistral): the Engine contract.

Those checkpoints are causal LMs (config.json names `Qwen3ForCausalLM`, often with no LM head in the
weights) whose sentence-transformers files pool the last token's hidden state and normalize it.
This engine runs the decoder engine's own layers (engines/decoder/model.py: the same weights, RoPE,
q/k norms, multipliers) over a packed batch of whole sequences, with no KV cache: each sequence
attends causally to itself (attention.causal_dense), and the hidden states after the final norm go
to the shared pooling code like an encoder's.

On a GPU a batch runs as a CUDA graph of its bucket (rows x width, right-padded: causal attention
keeps real tokens off the padding, so the graph's only input is the token ids), captured on first
use: the eager forward is ~15 launches a layer, which for a batch of short queries costs more than
the arithmetic. The real tokens' rows are gathered from the padded output.

A sequence's vector is bit for bit the same whatever shares its batch (`batch_invariant`, the default, as
the encoders'): on a GPU every GEMM runs on one Triton tiling, RMSNorm one program a row and attention on
the paged kernel's fixed tiling (DecoderModel(batch_invariant)), so neither the bucket nor the batch-mates
change a real token's arithmetic (cuBLAS and SDPA choose kernels by shape; torch's row reduction splits
a row across threads when there are few rows); on the CPU see run().
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import torch

from surge.engines.base import Capabilities, random_batch
from surge.engines.graph_capture import capture
from surge.errors import ConfigError
from surge.types import Layout, TokenBatch

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
WIDTH_BUCKETS = (8, 16, 32, 64, 128, 256, 512)
_NO_INDEX = torch.zeros(0, dtype=torch.int64)
GRAPH_TOKENS = 8192  # buckets above this many padded tokens run eagerly (launches no longer dominate)


def _bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


def check_standard(path: Path) -> None:
    """Refuse a checkpoint whose layers are not transformers' own: custom modeling code (`auto_map`, e.g.
    gte-Qwen2's bidirectional attention) or `is_causal: false`; served as the standard causal architecture,
    its vectors would be silently wrong."""
    import json

    config = json.loads((path / "config.json").read_text())
    if config.get("auto_map") or config.get("is_causal") is False:
        what = "custom modeling code (auto_map)" if config.get("auto_map") else "is_causal: false"
        raise ConfigError(f"{path.name}: config.json names {what}; surge runs transformers' own causal "
                          f"{config.get('model_type')} layers, which this checkpoint was not trained with")


class DecoderEmbedder:
    def __init__(self, device: str = "cpu", precision: str = "fp32", max_batch: int = 64, threads: int = 0,
                 cuda_graphs: bool = True, cpu_script: bool = True, batch_invariant: bool = True):
        """cpu_script: on the CPU, the layers as one TorchScript call without the GIL (embed_cpu.py; Llama-family
        layers), else the eager forward. batch_invariant: a sequence's vector is bit for bit the same whatever
        shares its batch (on the CPU: the script's GEMMs at row counts that keep a row's bits, each sequence
        in an attention block of its own; the eager forward runs each sequence alone; on a GPU: one GEMM tiling,
        RMSNorm a row a program, the paged attention kernel's fixed tiling, DecoderModel(batch_invariant))."""
        if precision not in _DTYPES:
            raise ConfigError(f"precision {precision} is not supported for decoder embedding models "
                              f"({', '.join(_DTYPES)})", param="precision")
        self.device = torch.device(device)
        self.dtype = _DTYPES[precision]
        if self.device.type == "cpu" and self.dtype is torch.float16:
            raise ConfigError("precision fp16 needs a GPU; on the CPU use fp32 or bf16", param="precision")
        if self.device.type == "cpu":
            if threads:
                torch.set_num_threads(threads)
            # beside a busy event loop every GIL take waits up to the switch interval (Python's default: 5 ms):
            # the TorchScript forward takes it a few times a batch, the eager one at every op
            from surge.engines.encoder_cpu import shorten_gil_switch

            shorten_gil_switch()
        self.max_batch = max_batch
        self.batch_invariant = batch_invariant
        self._chunks: list[int] = []  # invariant script: per GEMM of a layer, rows per call (embed_cpu.row_bounds)
        self.model = None
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.cpu_script = cpu_script and self.device.type == "cpu"
        self._script = self._layers = None
        # (rows, width) -> (ids buffer, hidden, graph, positions, meta): every input the graph reads stays referenced here
        self._graphs: dict[tuple[int, int], tuple] = {}
        self._pool = None  # one memory pool for every bucket's graph (replays never overlap: the lock)
        self.capabilities: Capabilities | None = None
        self._lock = threading.Lock()  # one forward at a time: the graphs' buffers and pool are shared

    def load(self, artifact: Path) -> None:
        from surge.engines.decoder.model import DecoderModel
        from surge.models.decoder import load_decoder_config, load_decoder_weights

        check_standard(Path(artifact))
        cfg = load_decoder_config(artifact)
        weights = load_decoder_weights(artifact, cfg, self.dtype, self.device)
        weights.pop("lm_head", None)  # embeddings never read the vocabulary's logits
        # the unfused layer: its attention is the dense causal one here (the fused path writes a cache)
        self.model = DecoderModel(cfg, weights, self.device, self.dtype, attention="torch", fused=False,
                                  batch_invariant=self.batch_invariant)
        self.vocab_size = cfg.vocab_size
        if self.cpu_script and cfg.arch == "llama":
            from surge.engines.decoder import embed_cpu

            self._script, self._layers = embed_cpu.scripted(), embed_cpu.layer_tensors(self.model)
            if self.batch_invariant and self._layers:
                self._chunks = embed_cpu.row_bounds(self._layers[0])
        self.capabilities = Capabilities(max_batch=self.max_batch, max_tokens=min(cfg.context_limit, 1 << 20),
                                         layout=Layout.PACKED, device=str(self.device),
                                         dtype={v: k for k, v in _DTYPES.items()}[self.dtype],
                                         hidden_size=cfg.hidden_size)

    def warmup(self, shapes: list[tuple[int, int]]) -> None:
        for batch, seq in shapes:
            self.run(random_batch(batch, seq, self.vocab_size, Layout.PACKED))

    def run(self, batch: TokenBatch) -> np.ndarray:
        """A packed batch's hidden states after the final norm, [T, H] float32."""
        if batch.layout is not Layout.PACKED:
            raise ValueError("the decoder embedder runs packed batches (its capabilities' layout)")
        lens = batch.lengths.tolist()
        ids = batch.input_ids
        if self.cuda_graphs:
            rows, width = _bucket(len(lens), ROW_BUCKETS), _bucket(max(lens), WIDTH_BUCKETS)
            if rows and width and rows * width <= GRAPH_TOKENS:
                return self._run_graph(ids, lens, rows, width)
        positions = np.concatenate([np.arange(n) for n in lens])
        if self._script is not None:
            return self._run_script(ids, positions, lens)
        if self.batch_invariant and self.device.type == "cpu" and len(lens) > 1:
            # the eager forward's GEMMs and attention round by the batch's shape: each sequence alone instead
            starts = np.concatenate([[0], np.cumsum(lens)])
            return np.concatenate([self._run_eager(ids[starts[i]:starts[i + 1]], [n], np.arange(n))
                                   for i, n in enumerate(lens)])
        return self._run_eager(ids, lens, positions)

    def _run_eager(self, ids: np.ndarray, lens: list[int], positions: np.ndarray) -> np.ndarray:
        from surge.engines.decoder.attention import DenseMeta

        with self._lock, torch.inference_mode():
            meta = DenseMeta(lens, self.device)
            hidden = self.model.forward(torch.as_tensor(ids, device=self.device),
                                        torch.as_tensor(positions, device=self.device), None, meta)
            return hidden.float().cpu().numpy()

    def _run_script(self, ids: np.ndarray, positions: np.ndarray, lens: list[int]) -> np.ndarray:
        from surge.engines.encoder_cpu import AttentionPlan, InvariantPlan

        m, c = self.model, self.model.cfg
        t = len(ids)
        inv: tuple = ([], [], [], _NO_INDEX)
        fill, block, mask = [], 0, None
        if self.batch_invariant:
            plan = InvariantPlan(np.asarray(lens), causal=True)
            pad = np.zeros(plan.tokens - t, dtype=np.int64)  # padding rows: token 0 at position 0, never returned
            ids, positions = np.concatenate([ids, pad]), np.concatenate([positions, pad])
            inv = (plan.blocks, plan.gathers, plan.masks, plan.back)
        else:
            plan = AttentionPlan(np.asarray(lens), causal=True)
            if not plan.single:
                fill, block, mask = plan.fill, plan.block, plan.mask
        with self._lock, torch.inference_mode():
            hidden = self._script(torch.as_tensor(ids), torch.as_tensor(positions), m.w["embed"], m.cos, m.sin,
                                  self._layers, m.w["final_norm"], c.norm_eps, c.num_heads, c.num_kv_heads,
                                  c.head_dim, m.scale, fill, block, mask, self._chunks if self.batch_invariant else [],
                                  *inv)
            return hidden[:t].float().numpy()

    def _run_graph(self, ids: np.ndarray, lens: list[int], rows: int, width: int) -> np.ndarray:
        padded = np.zeros((rows, width), dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)])
        for i, n in enumerate(lens):
            padded[i, :n] = ids[starts[i]:starts[i] + n]
        real = np.concatenate([i * width + np.arange(n) for i, n in enumerate(lens)])
        with self._lock, torch.inference_mode(), torch.cuda.device(self.device):  # captures on this engine's GPU
            buf, hidden, graph, *_ = self._graphs.get((rows, width)) or self._capture(rows, width)
            buf.copy_(torch.from_numpy(padded.reshape(-1)))
            graph.replay()
            # gathered and copied out before the lock is released: the next replay may reuse this memory
            return hidden.index_select(0, torch.as_tensor(real, device=self.device)).float().cpu().numpy()

    def _capture(self, rows: int, width: int):
        from surge.engines.decoder.attention import PaddedMeta

        buf = torch.zeros(rows * width, dtype=torch.long, device=self.device)
        positions = torch.arange(width, device=self.device).repeat(rows)
        meta = PaddedMeta(rows, width)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # cuBLAS handles and kernel choices made before the capture
            for _ in range(2):
                self.model.forward(buf, positions, None, meta)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, pool=self._pool):
            hidden = self.model.forward(buf, positions, None, meta)
        self._pool = graph.pool()
        self._graphs[rows, width] = (buf, hidden, graph, positions, meta)  # meta: the attention kernel's tables
        return self._graphs[rows, width]

    def close(self) -> None:
        self._graphs.clear()
        self.model = None

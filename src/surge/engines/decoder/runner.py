"""DecoderEngine: one step of the iteration scheduler on a device.

`step(scheduled)` packs the step's tokens (prefill chunks and decodes), runs the
model over the paged KV cache, computes logits only at the rows that sample, and
samples. A step of decodes only, on CUDA, is replayed from the CUDA graph of
the smallest captured batch-size bucket that holds it. Sync, no queues: time and
order live in runtime/ (the generation service drives this from one thread). Launched decode steps
(launch / collect, for the overlapped loop) are engines/decoder/launch.py; speculative steps (verify,
draft_tokens), engines/decoder/speculative.py: mixins of DecoderEngine.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from surge.engines.decoder.attention import AttnMeta
from surge.engines.decoder.graphs import RING as _RING
from surge.engines.decoder.launch import DecodeLaunches
from surge.engines.decoder.model import DecoderModel, KVCache
from surge.engines.decoder.sampler import SampleOut, Sampler
from surge.engines.decoder.speculative import SpeculativeRows
from surge.models.decoder import load_decoder_config, load_decoder_weights
from surge.runtime.scheduler.step import ScheduledSeq

log = logging.getLogger("surge.generate")
# the row graphs' largest bucket (rows of a prompt step a replay): 256 rows keep a row's attention, which is the
# decode kernel over its own context, within a decode step's work at the shapes measured (session 39)
ROW_GRAPH_ROWS = 256

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}

__all__ = ["DecoderEngine", "SampleOut", "EngineCaps"]


def _guides(path: Path, cfg):
    """The model's tokenizer for guided decoding (built at the first guided request, ~ms to 1 s)."""
    from surge.runtime.guided import Guides

    return Guides((path / "tokenizer.json").read_text(), cfg.vocab_size, cfg.eos_token_ids)


@dataclass(frozen=True)
class EngineCaps:
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: int
    # "fp8" / "int8": the layers' linear weights in 8 bits (models/weight_quant.py); "fp8-w8a8": FP8 weights whose
    # norm-fed products take FP8 rows too (kernels/fp8_rows.py); "w8a8": the CPU's INT8 products
    quantization: str = "none"


class DecoderEngine(DecodeLaunches, SpeculativeRows):
    def __init__(self, path: str | Path, *, device: str = "cpu", dtype: str | None = None, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_tokens: int | None = None, max_num_seqs: int = 64,
                 max_model_len: int | None = None, cuda_graphs: bool = True, attention: str | None = None,
                 threads: int = 0, fused: bool = True, graph_fp32_logits: bool = False,
                 decode_block_n: int | None = None, argmax_kernel: str = "triton", decode_gemm: str = "auto",
                 decode_attention: str = "fused", pdl: bool = True, l2_prefetch: bool = False,
                 decode_steps: int = 1, decode_launch_ms: float | None = None, max_loras: int = 0,
                 max_lora_rank: int = 16, lora_kernel: bool | None = None, lora_join: bool = True,
                 speculative_tokens: int = 0, graph_prefill_tokens: int = 512,
                 speculative_model: str | Path | None = None, quantization: str = "none",
                 cpu_weight_layout: str = "auto", fp8_activations: bool = True, beside_priority: int = -1):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if threads and not cuda:
            torch.set_num_threads(threads)
        self.dtype = _DTYPES[dtype or ("bf16" if cuda else "fp32")]
        self.cfg = load_decoder_config(path)
        limit = self.cfg.context_limit
        if self.cfg.sliding_window and (max_model_len or self.cfg.max_positions) > limit:
            log.warning("%s: sliding-window attention (a %d-token window) is not implemented; contexts are capped "
                        "at the window, within which the model's attention is exact", path, limit)
        self.max_model_len = min(max_model_len or limit, limit)
        self.block_size = block_size
        if num_blocks is None:
            tokens = kv_cache_tokens or self._default_kv_tokens(cuda, block_size)
            num_blocks = max(1, math.ceil(tokens / block_size))
        self.num_blocks = num_blocks
        self.max_num_seqs = max_num_seqs
        self._check_quantization(quantization)
        from surge.models.weight_quant import KINDS, SCALE_SUFFIX, supported

        # a quantized checkpoint's 8-bit weights stay as they are where the kernels run them
        # (models/quantized_checkpoint.py), else they are dequantized at load
        keep = tuple(d for k, d in KINDS.items() if supported(self.device, k)) \
            if self.dtype in (torch.bfloat16, torch.float16) else ()
        if quantization == "w8a8":  # a W8A8 checkpoint's INT8 codes are the CPU products' own form
            keep = (torch.int8,)
        weights = load_decoder_weights(path, self.cfg, self.dtype, self.device,
                                       quantize=None if quantization in ("none", "w8a8") else quantization,
                                       keep=keep)
        # LoRA adapters: `max_loras` slots, filled by load_adapter (engines/decoder/lora.py)
        self.lora = None
        if max_loras:
            from surge.engines.decoder.lora import LoraBank

            self.lora = LoraBank(self.cfg, max_loras, max_lora_rank, self.device, self.dtype, kernel=lora_kernel,
                                 join=lora_join)
        self.model = DecoderModel(self.cfg, weights, self.device, self.dtype,
                                  attention=attention or ("triton" if cuda else "torch"), fused=fused,
                                  decode_block_n=decode_block_n, decode_gemm=decode_gemm,
                                  decode_attention=decode_attention, pdl=pdl, l2_prefetch=l2_prefetch,
                                  lora=self.lora, cpu_weight_layout=cpu_weight_layout, decode_rows=max_num_seqs,
                                  cpu_w8a8=quantization == "w8a8", fp8_activations=fp8_activations)
        if self.model.cpu_layout:
            log.info("%s: linear weights kept %s, the LM head %s (cpu_weight_layout=%s)", path,
                     self.model.cpu_layout["layers"], self.model.cpu_layout["lm_head"], cpu_weight_layout)
        self.quantization = self.model.quantization  # what runs (a quantized checkpoint's too)
        if self.quantization != "none":
            log.info("%s: the layers' linear weights run as %s, %.0f MB", path, self.quantization,
                     sum(t.nbytes for n, t in weights.items() if n + SCALE_SUFFIX in weights) / 1e6)
        self.graph_fp32_logits = graph_fp32_logits  # session 2's graphs: FP32 logits, then the argmax
        self.argmax_kernel = argmax_kernel  # the graph's greedy argmax: "torch" or "triton" (argmax_rows)
        self.kv = KVCache(self.cfg, num_blocks, block_size, self.device, self.dtype)
        self.sampler = Sampler(self.device, guides=functools.partial(_guides, Path(path), self.cfg),
                               eos_ids=self.cfg.eos_token_ids)
        self.max_blocks_per_seq = -(-self.max_model_len // block_size)
        self.graphs = None
        # the longest a multi-step launch may take, at the step times its graphs measured (None: no cap)
        self.decode_launch_ms = decode_launch_ms
        self._pinned: list[torch.Tensor] = []
        # one read-back buffer and event per launched step that may be in flight (graphs.RING)
        self._events = [torch.cuda.Event() for _ in range(_RING)] if cuda else []
        self._slot = 0
        if cuda and cuda_graphs:
            from surge.engines.decoder.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_num_seqs, steps=decode_steps)
        # steps whose rows may share a sequence, a token a row at its own position: a short prompt's chunk
        # beside other sequences' decodes (step()), a sequence's input and drafts (verify()). On a GPU, CUDA
        # graphs of up to max(graph_prefill_tokens, the speculative steps' rows) rows
        self.speculative_tokens = speculative_tokens
        self.graph_prefill_tokens = graph_prefill_tokens if cuda and cuda_graphs else 0
        # a prompt step of more rows than the graphs hold replays them in chunks (graph memory stays bounded)
        rows = max(min(self.graph_prefill_tokens, ROW_GRAPH_ROWS),
                   max_num_seqs * (speculative_tokens + 1) if speculative_tokens else 0)
        self.row_graphs = None
        if cuda and cuda_graphs and rows:
            from surge.engines.decoder.graphs import DecodeGraphs

            self.row_graphs = DecodeGraphs(self, rows, rows_share_kv=True)
        # prompts prefilled while decode launches are in flight (runtime/scheduler/overlap.py's `beside`): the
        # row graphs replayed on a stream of their own, so a joining request does not queue behind the launches;
        # of a higher priority (lower number) by default, so that its blocks go first wherever the launches'
        # kernels leave an SM free (the prompt's one step against a few ms of decode steps)
        self.beside_stream = torch.cuda.Stream(priority=beside_priority) if self.row_graphs is not None else None
        # a draft model (runtime/scheduler/draft_model.py): its KV cache in blocks numbered as this one's
        self.draft = None
        if speculative_model is not None:
            self.draft = self._draft_engine(Path(speculative_model), Path(path), dtype, cuda_graphs)

    def _check_quantization(self, quantization: str) -> None:
        """A ConfigError saying why this device or dtype cannot run the quantization asked for."""
        from surge.errors import ConfigError
        from surge.models.weight_quant import supported

        if quantization not in ("none", "fp8", "int8", "w8a8"):
            raise ConfigError(f"quantization must be none, fp8, int8 or w8a8, not {quantization!r}")
        if quantization == "w8a8":  # engines/decoder/cpu_w8a8.py: integer products on the CPU
            if self.device.type != "cpu":
                raise ConfigError(f"quantization=w8a8 runs on the CPU (INT8 products by oneDNN), not {self.device}; "
                                  "on a GPU use fp8 or int8 (8-bit weights, BF16 products)")
            if self.dtype not in (torch.float32, torch.bfloat16):
                raise ConfigError(f"quantization=w8a8 runs FP32 or BF16 activations, not {self.dtype}")
            return
        on_cpu = "; on the CPU, quantization=w8a8 multiplies INT8 weights and activations" \
            if self.device.type == "cpu" else ""
        if quantization == "fp8" and not supported(self.device, "fp8"):
            raise ConfigError(f"quantization=fp8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, "
                              f"Hopper), not {self.device}: its kernels convert FP8 weight tiles in hardware{on_cpu}")
        if quantization == "int8" and not supported(self.device, "int8"):
            raise ConfigError(f"quantization=int8 needs a CUDA GPU of compute capability 8.0 or newer, not "
                              f"{self.device}: its kernels multiply the weights in BF16 / FP16 there{on_cpu}")
        if quantization != "none" and self.dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(f"quantization={quantization} runs BF16 or FP16 activations, not {self.dtype}")

    def _draft_engine(self, draft: Path, path: Path, dtype: str | None, cuda_graphs: bool) -> "DecoderEngine":
        """The draft model's engine: same device, precision, block size and number of blocks; its multi-step
        graphs run the k draft steps of a speculative step in one launch. A draft that cannot stand in for
        this model's tokens is refused."""
        from surge.errors import ConfigError

        if not self.speculative_tokens:
            raise ConfigError("a speculative model needs speculative_tokens >= 1")
        cfg = load_decoder_config(draft)
        if cfg.vocab_size > self.cfg.vocab_size:
            raise ConfigError(f"speculative model {draft}: its vocabulary ({cfg.vocab_size}) is larger than the "
                              f"model's ({self.cfg.vocab_size})")
        mine, theirs = path / "tokenizer.json", draft / "tokenizer.json"
        if mine.is_file() and theirs.is_file() and mine.read_bytes() != theirs.read_bytes():
            raise ConfigError(f"speculative model {draft}: its tokenizer.json differs from the model's")
        if cfg.context_limit < self.max_model_len:
            raise ConfigError(f"speculative model {draft}: its context ({cfg.context_limit} tokens) is shorter "
                              f"than max_model_len ({self.max_model_len})")
        return DecoderEngine(draft, device=str(self.device), dtype=dtype, block_size=self.block_size,
                             num_blocks=self.num_blocks, max_num_seqs=self.max_num_seqs,
                             max_model_len=self.max_model_len, cuda_graphs=cuda_graphs,
                             decode_steps=self.speculative_tokens)

    def _default_kv_tokens(self, cuda: bool, block_size: int) -> int:
        """256k tokens on a GPU, 32k on the CPU, within 40% of free GPU memory / 1 GiB of host memory."""
        per_token = KVCache.bytes_per_block(self.cfg, block_size, self.dtype) // block_size
        if cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            # the weights are not loaded yet: leave them and the activations room
            budget = int(0.4 * free)
        else:
            budget = 1 << 30
        want = 262_144 if cuda else 32_768
        return max(block_size * 4, min(want, budget // max(1, per_token)))

    @property
    def capabilities(self) -> EngineCaps:
        return EngineCaps(str(self.device), str(self.dtype).removeprefix("torch."), self.num_blocks, self.block_size,
                          self.max_num_seqs, self.max_model_len, self.quantization)

    def warmup(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()
        if self.row_graphs is not None:
            self.row_graphs.capture()
        if self.draft is not None:
            self.draft.warmup()

    # -- LoRA adapters ---------------------------------------------------------------------------------
    def read_adapter(self, path: str | Path, name: str | None = None):
        """A PEFT LoRA directory checked against this model and its slots' rank, in host memory
        (models/lora.LoraAdapter)."""
        if self.lora is None:
            raise ValueError("this engine was built without LoRA slots (max_loras=0)")
        from surge.models.lora import read_adapter

        return read_adapter(path, self.cfg, name, max_rank=self.lora.max_rank)

    def load_adapter(self, slot: int, adapter) -> None:
        """Write a LoRA adapter (read_adapter's, or a PEFT directory) into `slot` (1..max_loras); sequences
        with `adapter == slot` use it. On the engine loop's thread, between steps: the slot's weights are
        overwritten in place, behind the device work already queued (which may still read them)."""
        if not hasattr(adapter, "weights"):
            adapter = self.read_adapter(adapter)
        self.lora.load(slot, adapter)

    def _row_slots(self, seqs) -> list[int] | None:
        """The rows' LoRA slots for a graph launch (None without slots: nothing to stage)."""
        return [q.adapter for q in seqs] if self.lora is not None else None

    def _adapters(self, scheduled: list[ScheduledSeq]) -> torch.Tensor | None:
        """Each packed token's LoRA slot, or None when no sequence of the step has an adapter."""
        if self.lora is None or not any(s.seq.adapter for s in scheduled):
            return None
        slots = np.repeat([s.seq.adapter for s in scheduled], [s.num_tokens for s in scheduled])
        return torch.as_tensor(np.asarray(slots, dtype=np.int64)).to(self.device, non_blocking=True)

    # -- one step ----------------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledSeq]):
        bs = self.block_size
        ids, pos, slots, q_lens, ctx, tables = [], [], [], [], [], []
        for s in scheduled:
            seq, n, start = s.seq, s.num_tokens, s.start
            ids.extend(seq.token_ids[start:start + n])
            p = np.arange(start, start + n)
            pos.append(p)
            table = np.asarray(seq.block_table, dtype=np.int64)
            slots.append(table[p // bs] * bs + p % bs)
            q_lens.append(n)
            ctx.append(start + n)
            tables.append(seq.block_table)
        pos_np = np.concatenate(pos)
        slots_np = np.concatenate(slots)
        width = max(len(t) for t in tables)
        table_np = np.full((len(tables), width), self.kv.scratch_block, dtype=np.int32)
        for i, t in enumerate(tables):
            table_np[i, :len(t)] = t
        qstart = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qstart[1:])
        return ids, pos_np, slots_np, q_lens, ctx, tables, table_np, qstart

    def attn_meta(self, slots, table_np, ctx, qstart, q_lens, tables) -> AttnMeta:
        """A step's attention metadata (prepare()'s host arrays) on the device, copied without a sync."""
        dev = self.device
        return AttnMeta(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(table_np).to(dev, non_blocking=True),
            context_lens=torch.tensor(ctx, dtype=torch.int32).to(dev, non_blocking=True),
            query_start=torch.from_numpy(qstart).to(dev, non_blocking=True),
            max_query=max(q_lens, default=1), q_lens=q_lens, ctx_lens=ctx, tables=tables)

    @torch.inference_mode()
    def step(self, scheduled: list[ScheduledSeq]) -> dict[int, SampleOut]:
        if not scheduled:
            return {}
        if self.graphs is not None and self.graphs.graphs and len(scheduled) <= self.graphs.buckets[-1] \
                and all(s.num_tokens == 1 and s.sample for s in scheduled):
            return self._decode_graph(scheduled)
        self._prepare_guides(scheduled)
        if self._graph_rows(scheduled):
            return self._prefill_graph(scheduled)
        ids, pos, slots, q_lens, ctx, tables, table_np, qstart = self.prepare(scheduled)
        sample_rows = [i for i, s in enumerate(scheduled) if s.sample]
        dev = self.device
        meta = self.attn_meta(slots, table_np, ctx, qstart, q_lens, tables)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
                                    torch.from_numpy(pos).to(dev, non_blocking=True), self.kv, meta,
                                    self._adapters(scheduled))
        if any(s.seq.owes_prompt_logprobs for s in scheduled):
            self._score_prompts(scheduled, hidden, qstart)
        if not sample_rows:
            return {}
        last = torch.as_tensor(qstart[1:][sample_rows] - 1, dtype=torch.long).to(dev, non_blocking=True)
        logits = self.model.logits(hidden.index_select(0, last))
        seqs = [scheduled[i].seq for i in sample_rows]
        return self._outs(seqs, self.sampler(logits, seqs))

    def _prepare_guides(self, scheduled: list[ScheduledSeq]) -> None:
        """Guided prompts: their matchers built while the step runs (before either prefill path)."""
        if any(s.seq.params.guide is not None and s.start < s.seq.num_prompt for s in scheduled):
            self.sampler.prepare([s.seq for s in scheduled])

    @staticmethod
    def _outs(seqs, outs) -> dict[int, SampleOut]:
        """{seq_id: SampleOut}; a sequence's scored prompt goes out with its first sampled token."""
        for seq, o in zip(seqs, outs):
            if seq.prompt_lps is not None:
                o.prompt, seq.prompt_lps = seq.prompt_lps, None
        return {seq.seq_id: o for seq, o in zip(seqs, outs)}

    def _graph_rows(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether this step runs as rows of the CUDA graphs (row_graphs): at most graph_prefill_tokens tokens in
        all, whose prompt rows attend to no more keys in all than a prompt of graph_prefill_tokens tokens does
        from its start (a row's attention is the decode kernel over its whole context, so a short chunk after a
        long cached context reads that context once a row: eager then), their tables within the graphs', no
        prompt log-probabilities to score (those read every position's hidden state, which a graph does not
        keep)."""
        g, limit = self.row_graphs, self.graph_prefill_tokens
        if g is None or not g.graphs:
            return False
        n = sum(s.num_tokens for s in scheduled)
        keys = sum(s.num_tokens * s.start + s.num_tokens * (s.num_tokens + 1) // 2 for s in scheduled
                   if s.num_tokens > 1)
        return n <= limit and keys <= limit * (limit + 1) // 2 \
            and g.fits(min(n, g.buckets[-1]), max(len(s.seq.block_table) for s in scheduled)) \
            and not any(s.seq.owes_prompt_logprobs for s in scheduled)

    def _rows(self, runs):
        """ids, positions, cache slots, block tables and LoRA slots (None without slots) of rows given as
        (sequence, first position, tokens) runs: a row a token at its own position, in its sequence's table."""
        bs = self.block_size
        ids, pos, slots, tables, adapters = [], [], [], [], []
        for seq, p0, tokens in runs:
            t, n = seq.block_table, len(tokens)
            ids.extend(tokens)
            for p in range(p0, p0 + n):
                pos.append(p)
                slots.append(t[p // bs] * bs + p % bs)
            tables.extend([t] * n)
            adapters.extend([seq.adapter] * n)
        if any(t < 0 for t in ids):
            raise RuntimeError("a row's input token is not known yet (a launched step in flight)")
        return ids, pos, slots, tables, adapters if self.lora is not None else None

    def _prefill_graph(self, scheduled: list[ScheduledSeq]) -> dict[int, SampleOut]:
        """step() as replays of the row graphs: every token of the step a row (prompt chunks and decodes
        alike), each attending to its sequence's cache up to itself; more rows than the largest bucket run as
        several replays in order (a row then reads the keys of earlier replays' rows from the cache). The
        sampled sequences' last rows go to the sampler."""
        ids, pos, slots, tables, adapters = self._rows(
            [(s.seq, s.start, s.seq.token_ids[s.start:s.start + s.num_tokens]) for s in scheduled])
        g, n = self.row_graphs, len(ids)
        sampled = [i for i, s in enumerate(scheduled) if s.sample]
        last = np.cumsum([s.num_tokens for s in scheduled])[sampled] - 1 if sampled else np.zeros(0, np.int64)
        parts, per = [], g.buckets[-1]
        for lo in range(0, n, per):
            hi = min(n, lo + per)
            logits, _ = g.run(ids[lo:hi], pos[lo:hi], slots[lo:hi], tables[lo:hi],
                              adapters=adapters[lo:hi] if adapters is not None else None)
            rows = last[(last >= lo) & (last < hi)] - lo
            if len(rows):  # read before the next replay overwrites the graph's output (stream order)
                parts.append(logits.index_select(0, torch.as_tensor(rows).to(self.device, non_blocking=True)))
        if not sampled:
            return {}
        seqs = [scheduled[i].seq for i in sampled]
        return self._outs(seqs, self.sampler(parts[0] if len(parts) == 1 else torch.cat(parts), seqs))

    def _score_prompts(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor, qstart) -> None:
        """The model's log-probabilities of the prompt tokens this step computed the positions before
        (OpenAI's `echo` with `logprobs`): position p scores token p + 1, from the raw logits as the
        sampled tokens' are. A position is scored once, also when a preempted sequence recomputes it."""
        for i, s in enumerate(scheduled):
            seq = s.seq
            if not seq.owes_prompt_logprobs:
                continue
            lo, hi = max(s.start, seq.prompt_scored), min(s.start + s.num_tokens, seq.num_prompt - 1)
            if lo >= hi:
                continue
            rows = torch.arange(qstart[i] + lo - s.start, qstart[i] + hi - s.start, device=hidden.device)
            lp = torch.log_softmax(self.model.logits(hidden.index_select(0, rows)).float(), dim=-1)
            nxt = torch.tensor(seq.token_ids[lo + 1:hi + 1], device=hidden.device)
            chosen_t = lp.gather(1, nxt[:, None])
            chosen = chosen_t[:, 0].tolist()
            ranks = ((lp > chosen_t).sum(-1) + 1).tolist()  # vLLM's Logprob.rank, as the sampler's
            k = seq.params.prompt_logprobs
            top_v, top_i = (lp.topk(k, dim=-1) if k else (None, None))
            tops = [list(zip(ti, tv)) for ti, tv in zip(top_i.tolist(), top_v.tolist())] if k else [[]] * len(chosen)
            seq.prompt_lps = (seq.prompt_lps or []) + list(zip(seq.token_ids[lo + 1:hi + 1], chosen, tops, ranks))
            seq.prompt_scored = hi

    def _decode_graph(self, scheduled: list[ScheduledSeq]) -> dict[int, SampleOut]:
        if self.can_launch(scheduled):
            return self.collect(self.launch(scheduled, None))
        bs = self.block_size
        seqs = [s.seq for s in scheduled]
        pos = [s.start for s in scheduled]
        ids = [q.token_ids[p] for q, p in zip(seqs, pos)]
        tables = [q.block_table for q in seqs]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
        if max(len(t) for t in tables) > self.graphs.width:
            raise ValueError("a block table is wider than max_model_len allows")
        logits, _ = self.graphs.run(ids, pos, slots, tables, adapters=self._row_slots(seqs))
        return self._outs(seqs, self.sampler(logits, seqs))

    def can_prefill_beside(self, scheduled: list[ScheduledSeq]) -> bool:
        """Whether prefill_beside() can run these prompt chunks: each ends its prompt (samples), the step takes
        the row graphs (_graph_rows), and no row needs a LoRA slot (an adapter is copied into its slot on the
        launches' stream, behind them)."""
        lora = self.lora is not None and any(s.seq.adapter for s in scheduled)
        return all(s.sample for s in scheduled) and not lora and self._graph_rows(scheduled)

    @torch.inference_mode()
    def prefill_beside(self, scheduled: list[ScheduledSeq]) -> dict[int, SampleOut]:
        """step() of prompt chunks that can_prefill_beside(), while decode launches are in flight: the row graphs
        replayed on beside_stream, which does not wait for the launches (the scheduler gave these sequences blocks
        no launch in flight writes: BlockManager.settled); returns once their tokens are sampled."""
        self._prepare_guides(scheduled)
        if self.beside_stream is None:  # (the CPU tests' harness graphs)
            return self._prefill_graph(scheduled)
        with torch.cuda.stream(self.beside_stream):
            return self._prefill_graph(scheduled)

    def forget(self, seq_id: int) -> None:
        self.sampler.forget(seq_id)

    def rewind(self, seq) -> None:
        """A step of `seq` raised and it runs again (StepLoop.contain): its sampling state back to its tokens."""
        self.sampler.rewind(seq)

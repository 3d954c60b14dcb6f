"""GPT-2 and Llama / Qwen2 forward passes over packed tokens and a paged KV cache.

Plain torch ops on weights laid out by models/decoder.py (fused q/k/v and
gate/up GEMMs). The same code runs FP32 / BF16 on the CPU and BF16 / FP16 on the
GPU, where attention is the Triton paged kernel and decode steps are replayed
from CUDA graphs (engines/decoder/graphs.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from surge.engines.decoder import cpu_layout
from surge.engines.decoder.attention import (AttnMeta, causal_dense, causal_dense_invariant, paged_attention_torch,
                                            write_kv)
from surge.models.decoder import LINEAR_MODULES, DecoderConfig, is_layer_linear, rope_inv_freq
from surge.models.weight_quant import FP8, SCALE_SUFFIX, kind_of

# the linear modules whose input is a norm's output: with FP8 weights they can take FP8 input rows (W8A8)
FP8_INPUT_MODULES = ("qkv", "up_gate", "fc_in")


# The layer's pieces as free functions in TorchScript's subset: the decoder embedder's CPU forward
# (embed_cpu.py) compiles the same ones.
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: in FP32, cast back, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] rotated as transformers' rotate_half does, over cos / sin's first dims (partial rotary)."""
    r = cos.size(-1)
    half = r // 2
    xr = x.narrow(-1, 0, r)  # narrow, not x[..., :r]: no op of the compiled forward may re-take the GIL
    rotated = torch.cat([-xr.narrow(-1, half, r - half), xr.narrow(-1, 0, half)], dim=-1)
    out = xr * cos + rotated * sin
    if r == x.size(-1):
        return out
    return torch.cat([out, x.narrow(-1, r, x.size(-1) - r)], dim=-1)


class DecoderModel:
    _fp8_act: frozenset | set = frozenset()  # the FP8 weights taking FP8 input rows (set in __init__)
    batch_invariant = False  # (set in __init__)

    def __init__(self, cfg: DecoderConfig, weights: dict, device: torch.device, dtype: torch.dtype,
                 attention: str = "torch", fused: bool = True, decode_block_n: int | None = None,
                 decode_gemm: str = "auto", decode_attention: str = "fused", pdl: bool = True,
                 l2_prefetch: bool | str = False, lora=None, cpu_weight_layout: str = "in_out",
                 decode_rows: int = 8, cpu_w8a8: bool = False, fp8_activations: bool = False,
                 batch_invariant: bool = False):
        """batch_invariant (CUDA, the unfused layers without a cache: the decoder embedder): every GEMM on one
        Triton tiling (kernels/gemm.linear_invariant), RMSNorm one program a row, attention the paged kernel
        in its fixed tiling, so a token's hidden state never depends on what shares its batch."""
        self.cfg = cfg
        self.batch_invariant = batch_invariant and device.type == "cuda"
        if self.batch_invariant:
            from surge.engines.kernels.decoder_fused import add_rmsnorm
            from surge.engines.kernels.gemm import linear_invariant

            self._rms_rows, self._linear_invariant = add_rmsnorm, linear_invariant
        # LoRA adapters (engines/decoder/lora.LoraBank): their deltas join the layers' GEMM outputs
        self.lora = lora
        self.w = weights
        # 8-bit linear weights (models/weight_quant.py; load_decoder_weights(quantize=...), a quantized checkpoint's
        # kept): name -> its [N] FP32 scales
        self._scales = {n.removesuffix(SCALE_SUFFIX): t for n, t in weights.items() if n.endswith(SCALE_SUFFIX)}
        if self._scales and device.type != "cuda" and not cpu_w8a8:
            raise ValueError("8-bit (FP8 / INT8) weights run on a CUDA GPU only")
        self.device = device
        self.dtype = dtype
        # FP8 weights whose input is a norm's output (qkv, gate/up; GPT-2's fc_in): with fp8_activations, where the
        # GPU has FP8 tensor cores, that input's rows are quantized to FP8 too (the norm kernel writes them) and the
        # product is cuBLASLt's FP8 GEMM (kernels/fp8_rows.py: W8A8, faster than converting the weight's tiles).
        # The o and down products keep BF16 inputs: their inputs come from kernels that hold parts of a row, and
        # at 64 rows the weight-only kernels match or beat cuBLASLt's there (benchmarks/gpu_fp8_forms.py).
        self._fp8_act: set[str] = set()
        if fp8_activations and self._scales and device.type == "cuda":
            from surge.engines.kernels import fp8_rows

            if fp8_rows.supported(device.index or 0):
                self._fp8_rows = fp8_rows
                self._fp8_act = {n for n in self._scales if n.partition(".")[2] in FP8_INPUT_MODULES
                                 and self.w[n].dtype == FP8 and fp8_rows.fits(*self.w[n].shape)}
        self.scale = cfg.attention_scale or 1.0 / math.sqrt(cfg.head_dim)
        self.attention = attention
        if decode_block_n is None and attention == "triton":  # the measured value for the head layout
            from surge.engines.kernels.decode_attention import block_n_for

            decode_block_n = block_n_for(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.decode_block_n = decode_block_n  # keys per iteration of the paged kernel in decode steps
        self.fused = False
        if decode_gemm not in ("auto", "splitk", "cublas"):
            raise ValueError(f"decode_gemm must be auto, splitk or cublas, not {decode_gemm!r}")
        # the CPU's linear weights [in, out] or [out, in]; "auto" measures both here (cpu_layout.py)
        self.cpu_layout = {}
        # W8A8 on the CPU (cpu_w8a8.py): every linear weight and the LM head as INT8, products in integers
        self._w8a8 = {}
        if cpu_w8a8:
            if device.type != "cpu":
                raise ValueError("W8A8 (integer products) runs on the CPU only")
            from surge.engines.decoder import cpu_w8a8 as w8a8

            self._w8a8 = w8a8.quantize_weights(weights, [n for n in weights if is_layer_linear(n)] + ["lm_head"],
                                               rows=decode_rows)
            self._scales = {}  # a W8A8 checkpoint's INT8 weights and scales: now the W8A8 table's
            self._w8a8_linear = w8a8.linear
            self.cpu_layout = {"layers": "w8a8", "lm_head": "w8a8"}
        self._wt = self._lay_out_cpu(weights, cpu_weight_layout, decode_rows) \
            if device.type == "cpu" and not cpu_w8a8 else {}
        if attention == "triton":
            from surge.engines.kernels.paged_attention import paged_attention

            self._triton = paged_attention
        if cfg.arch == "llama":
            inv, att_scale = rope_inv_freq(cfg)
            pos = torch.arange(cfg.max_positions, dtype=torch.float32)
            freqs = pos[:, None] * inv[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            # transformers computes cos/sin in float32 and casts to the activations' dtype
            self.cos = (emb.cos() * att_scale).to(device=device, dtype=dtype)
            self.sin = (emb.sin() * att_scale).to(device=device, dtype=dtype)
            self.rot_dim = emb.shape[-1]
            d = cfg.head_dim
            # the fused kernels (GPU): full rotary dims, a power-of-two head size, no per-head q/k norm (Qwen3's
            # runs the unfused layer: its GEMMs, RoPE and paged attention as separate kernels), no o or MLP biases
            self.fused = attention == "triton" and fused and self.rot_dim == d and d >= 16 and d & (d - 1) == 0 \
                and not (cfg.qk_norm or cfg.o_bias or cfg.mlp_bias)
        if decode_attention not in ("fused", "split"):
            raise ValueError(f"decode_attention must be fused or split, not {decode_attention!r}")
        # decode steps: RoPE, the K/V cache write and attention in one kernel (kernels/decode_attention.py)
        # rather than rope_and_cache + paged_attention
        self.decode_attention = decode_attention if self.fused else "split"
        # programmatic dependent launch of the fused path's Triton kernels (kernels/pdl.py): asked for,
        # and only where the GPU and Triton have it
        self.pdl = bool(pdl) and self.fused and self._pdl_supported()
        self._splitk = self._splitk_plans(decode_gemm) if self.fused else {}
        # decode steps: each layer's weights asked into L2 from a side stream a phase ahead
        # (kernels/l2_prefetch.py); asked for, and only where the GPU has the bulk prefetch
        self._pf_stream = None
        # True / "mlp": the MLP's two matrices at the layer's start, the next layer's qkv and o at the MLP's;
        # "staggered": gate/up at the layer's start, then down and the next layer's qkv and o at the MLP's
        if l2_prefetch not in (False, True, "mlp", "staggered"):
            raise ValueError(f"l2_prefetch must be False, True, 'mlp' or 'staggered', not {l2_prefetch!r}")
        self._pf_plan = "staggered" if l2_prefetch == "staggered" else "mlp"
        if l2_prefetch and self.fused and device.type == "cuda":
            from surge.engines.kernels import l2_prefetch as l2

            if l2.supported(device.index or 0):
                self._pf_stream, self._bulk_prefetch = torch.cuda.Stream(device), l2.bulk_prefetch
        self._gate_up_max_m = 0  # rows up to which the one-kernel gate/up runs (set with its plans)
        self._gate_up = self._gate_up_plans(decode_gemm) if self.fused else {}
        if self.fused:  # resolved once here, not in every layer of every step
            from surge.engines.kernels.decoder_fused import silu_mul

            self._silu_mul = silu_mul
        if self._splitk:
            from surge.engines.kernels.splitk_gemm import MAX_M, partials

            self._splitk_max_m, self._partials = MAX_M, partials
        else:
            self._splitk_max_m = 0
        # 8-bit weights outside the fused layer's plans (GPT-2, Qwen3, the LoRA torch form): the split-K
        # kernel with reduce at decode sizes
        self._q8_plans = {}
        if self._scales:
            from surge.engines.kernels import splitk_gemm

            self._q8_plans = {n: splitk_gemm.q8_plan_for(*self.w[n].shape) for n in self._scales}
            from surge.engines.kernels.dequant import dequantize as dequantize_kernel

            self._q8_max_m, self._q8_linear_kernel = splitk_gemm.Q8_MAX_M, splitk_gemm.linear
            self._q8_dequantize = dequantize_kernel

    @property
    def quantization(self) -> str:
        """"fp8" / "int8" where the layers' linear weights are 8-bit (models/weight_quant.py), "fp8-w8a8" where
        FP8 weights also take FP8 inputs (the norm-fed products: kernels/fp8_rows.py), "w8a8" where the CPU
        multiplies in integers (cpu_w8a8.py), else "none"."""
        if self._w8a8:
            return "w8a8"
        kinds = {kind_of(self.w[n].dtype) for n in self._scales}
        if self._fp8_act:
            kinds = (kinds - {"fp8"}) | {"fp8-w8a8"}
        return "+".join(sorted(kinds)) if kinds else "none"

    def _pdl_supported(self) -> bool:
        from surge.engines.kernels import pdl

        return pdl.supported(self.device.index or 0)

    def _splitk_plans(self, mode: str) -> dict:
        """Weight name -> split-K plan for the layers' GEMMs at <= splitk_gemm.MAX_M rows (decode steps).
        "auto": the plans measured for the weight's (N, K) (cuBLAS where none is recorded or cuBLAS
        won); "splitk": every such GEMM (an unmeasured shape gets default_plan: tests, measurements);
        "cublas": none. BF16 / FP16 only: FP32 weights stay on cuBLAS's FP32 (Triton's dot would be TF32).
        An 8-bit weight has a plan but under "cublas" (cuBLAS has no BF16 x FP8 / INT8 product)."""
        if mode == "cublas" or self.dtype not in (torch.bfloat16, torch.float16):
            return {}
        from surge.engines.kernels import splitk_gemm

        plans = {}
        for i in range(self.cfg.num_layers):
            for name in ("qkv", "o", "up_gate", "down"):
                wt = self.w[f"l{i}.{name}"]
                if wt.stride(1) != 1:  # the kernel reads rows of K contiguous elements
                    continue
                n, k = wt.shape
                if f"l{i}.{name}" in self._fp8_act:  # cuBLASLt's FP8 GEMM at every size
                    continue
                if f"l{i}.{name}" in self._scales:
                    plans[f"l{i}.{name}"] = splitk_gemm.q8_plan_for(n, k)
                    continue
                plan = splitk_gemm.plan_for(n, k)
                if plan is None and mode == "splitk":
                    plan = splitk_gemm.default_plan(n, k)
                if plan is not None:
                    plans[f"l{i}.{name}"] = plan
        return plans

    def _gate_up_plans(self, mode: str) -> dict:
        """Layer -> plan of the one-kernel SiLU(gate) * up (kernels/gate_up.py) at <= its MAX_M rows, as
        `_splitk_plans` decides for the split-K GEMMs: measured plans ("auto"), every layer ("splitk",
        default_plan where unmeasured), none ("cublas", and FP32 weights): cuBLAS + silu_mul."""
        if mode == "cublas" or self.dtype not in (torch.bfloat16, torch.float16):
            return {}
        from surge.engines.kernels import gate_up

        plans = {}
        for i in range(self.cfg.num_layers):
            wt = self.w[f"l{i}.up_gate"]
            if wt.stride(1) != 1:
                continue
            inter, k = wt.shape[0] // 2, wt.shape[1]
            if f"l{i}.up_gate" in self._fp8_act:
                continue
            if f"l{i}.up_gate" in self._scales:
                plans[f"l{i}.up_gate"] = gate_up.q8_plan_for(inter, k)
                continue
            plan = gate_up.plan_for(inter, k)
            if plan is None and mode == "splitk":
                plan = gate_up.default_plan(inter, k)
            if plan is not None:
                plans[f"l{i}.up_gate"] = plan
        if plans:
            self._gate_up_silu, self._gate_up_max_m = gate_up.gate_up_silu, gate_up.MAX_M
        return plans

    def _mlp_in(self, h: torch.Tensor, layer: int, masks=None, h8=None) -> torch.Tensor:
        """SiLU(h W_gate^T) * (h W_up^T): one kernel at decode sizes where a plan exists (the rows' LoRA
        deltas joined inside it where the bank runs kernels), else the GEMM (cuBLAS, or split-K partials, or
        the FP8 GEMM on h8, h's FP8 rows), the adapters' deltas, and silu_mul."""
        name = f"l{layer}.up_gate"
        plan = self._gate_up.get(name) if h.shape[0] <= self._gate_up_max_m else None
        lora = masks.operands(layer, "up_gate") if masks is not None and plan is not None else None
        if plan is not None and (masks is None or lora is not None):
            return self._gate_up_silu(h, self.w[name], plan, pdl=self.pdl, lora=lora, scale=self._scales.get(name))
        return self._silu_mul(self._proj_lora(h, layer, "up_gate", masks, x8=h8), h.dtype, pdl=self.pdl)

    def _proj_lora(self, x: torch.Tensor, layer: int, module: str, masks, bias: torch.Tensor | None = None,
                   x8=None):
        """`_proj` plus the rows' LoRA deltas: at decode sizes joined inside the split-K GEMM (each split
        adds its K range's share: kernels/lora_delta.join_deltas; no launch of their own), else added to
        the plain product (a side-stream shrink and an expand kernel, or the torch form)."""
        name = f"l{layer}.{module}"
        plan = self._splitk_plan(x, name) if masks is not None else None
        lora = masks.operands(layer, module) if plan is not None else None
        if lora is not None:
            return self._partials(x, self.w[name], plan, pdl=self.pdl, lora=lora, scale=self._scales.get(name))
        pending = masks.begin(x, layer, module) if masks is not None else None
        return self._add_lora(self._proj(x, name, bias, x8), pending)

    @staticmethod
    def _add_lora(out: torch.Tensor, pending) -> torch.Tensor:
        """out (a fresh product: changed in place) plus the rows' deltas begun before it (lora.LoraStep.begin);
        split-K partials take them in the first."""
        if pending is None:
            return out
        pending.finish_(out[0] if out.dim() == 3 else out)
        return out

    # -- pieces ---------------------------------------------------------------------------------------
    LINEAR = LINEAR_MODULES

    def _lay_out_cpu(self, w: dict, layout: str, rows: int) -> dict:
        if layout not in cpu_layout.LAYOUTS:
            raise ValueError(f"cpu_weight_layout must be one of {', '.join(cpu_layout.LAYOUTS)}, not {layout!r}")
        chosen = cpu_layout.choose(w, self.LINEAR, rows) if layout == "auto" else \
            {"layers": layout, "lm_head": layout}
        self.cpu_layout = chosen
        return cpu_layout.lay_out(w, self.LINEAR, **chosen)

    def _lin(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None, x8=None) -> torch.Tensor:
        """x @ W^T (+ bias) by the weight's form; x8: x's FP8 rows (q, scale) where a kernel made them already."""
        if name in self._fp8_act:
            xq, xs = x8 if x8 is not None else self._fp8_rows.quantize_rows(x)
            return self._fp8_rows.scaled_linear(xq, xs, self.w[name], self._scales[name], bias, x.dtype)
        q = self._w8a8.get(name)
        if q is not None:
            return self._w8a8_linear(x, q, bias)
        if name in self._scales:
            return self._q8_linear(x, name, bias)
        wt = self._wt.get(name)
        if wt is None:
            if self.batch_invariant:
                w = self.w[name]
                out = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
                return self._linear_invariant(x.contiguous(), w, bias, out)
            return F.linear(x, self.w[name], bias)
        return torch.addmm(bias, x, wt) if bias is not None else x @ wt

    def _q8_linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None) -> torch.Tensor:
        """A linear module with 8-bit weights: up to splitk_gemm.Q8_MAX_M rows the split-K kernel on the 8-bit
        tiles (the scales on its sums; the weights read at one byte each), above them cuBLAS on the weight
        dequantized for the call by one kernel (a prefill chunk's product is bound by its arithmetic more than by
        the weight's bytes)."""
        w, scale = self.w[name], self._scales[name]
        if x.shape[0] <= self._q8_max_m:
            return self._q8_linear_kernel(x, w, self._q8_plans[name], bias, scale=scale)
        return F.linear(x, self._q8_dequantize(w, scale, x.dtype), bias)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:  # torch's row reduction splits a row across threads by the number of rows
            shape = x.shape
            return self._rms_rows(x.reshape(-1, shape[-1]).contiguous(), None, w, self.cfg.norm_eps).view(shape)
        return rms_norm(x, w, self.cfg.norm_eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rope(x, cos, sin)

    def _attend(self, q, k, v, layer: int, kv, meta: AttnMeta) -> torch.Tensor:
        if kv is None:  # no cache (embeddings): meta is a DenseMeta or PaddedMeta
            if self.batch_invariant:
                return causal_dense_invariant(q, k, v, meta, self.scale)
            return causal_dense(q, k, v, meta, self.scale)
        k_cache, v_cache = kv.k[layer], kv.v[layer]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        if self.attention == "triton":
            return self._triton(q, k_cache, v_cache, meta, self.scale)
        return paged_attention_torch(q, k_cache, v_cache, meta, self.scale)

    # -- forward ----------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv, meta: AttnMeta,
                adapters: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm. `adapters` [T]: each token's LoRA slot (0: none);
        None: no token has one (the adapters' GEMMs are skipped). kv None: no cache, `meta` an
        attention.DenseMeta (whole sequences, each attending to itself: embeddings)."""
        masks = self.lora.step(adapters, pdl=self.pdl) if self.lora is not None and adapters is not None else None
        if self.cfg.arch == "gpt2":
            return self._gpt2(input_ids, positions, kv, meta, masks)
        return self._llama(input_ids, positions, kv, meta, masks)

    def _lin_lora(self, x: torch.Tensor, layer: int, module: str, masks, bias: torch.Tensor | None = None):
        """The layer's linear module, plus its LoRA deltas where the step's rows have adapters."""
        pending = masks.begin(x, layer, module) if masks is not None else None
        return self._add_lora(self._lin(x, f"l{layer}.{module}", bias), pending)

    def _gpt2(self, ids, positions, kv, meta, masks=None):
        c, w = self.cfg, self.w
        t = ids.shape[0]
        x = F.embedding(ids, w["embed"]) + F.embedding(positions, w["pos_embed"])
        hd, nh = c.head_dim, c.num_heads
        for i in range(c.num_layers):
            p = f"l{i}."
            h = F.layer_norm(x, (c.hidden_size,), w[p + "attn_norm"], w[p + "attn_norm.bias"], c.norm_eps)
            qkv = self._lin_lora(h, i, "qkv", masks, w[p + "qkv.bias"]).view(t, 3, nh, hd)
            q, k, v = qkv[:, 0], qkv[:, 1].contiguous(), qkv[:, 2].contiguous()
            a = self._attend(q.contiguous(), k, v, i, kv, meta).reshape(t, c.hidden_size)
            x = x + self._lin_lora(a, i, "o", masks, w[p + "o.bias"])
            h = F.layer_norm(x, (c.hidden_size,), w[p + "mlp_norm"], w[p + "mlp_norm.bias"], c.norm_eps)
            h = F.gelu(self._lin_lora(h, i, "fc_in", masks, w[p + "fc_in.bias"]),
                       approximate="none" if c.rope.get("activation") == "gelu" else "tanh")
            x = x + self._lin_lora(h, i, "fc_out", masks, w[p + "fc_out.bias"])
        return F.layer_norm(x, (c.hidden_size,), w["final_norm"], w["final_norm.bias"], c.norm_eps)

    def _proj(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None, x8=None) -> torch.Tensor:
        """F.linear, or at decode sizes with a split-K plan its FP32 partial sums [S, T, N], which the
        fused kernel that reads the product sums in order (the bias is then that kernel's to add)."""
        plan = self._splitk_plan(x, name)
        if plan is None:
            return self._lin(x, name, bias, x8)
        return self._partials(x, self.w[name], plan, pdl=self.pdl, scale=self._scales.get(name))

    def _splitk_plan(self, x: torch.Tensor, name: str):
        return self._splitk.get(name) if x.shape[0] <= self._splitk_max_m else None

    def _llama_fused(self, ids, positions, kv, meta, masks=None):
        from surge.engines.kernels.decode_attention import decode_attention
        from surge.engines.kernels.decoder_fused import add_rmsnorm, rope_and_cache

        c, w = self.cfg, self.w
        t = ids.shape[0]
        pdl = self.pdl
        x = F.embedding(ids, w["embed"])  # the residual stream, updated in place
        hd, nq, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        one_kernel = meta.max_query == 1 and self.decode_attention == "fused" and not meta.rows_share_kv

        def norm(delta, weight, feeds: str):  # h, and h's FP8 rows where `feeds` multiplies them
            if feeds not in self._fp8_act:
                return add_rmsnorm(x, delta, weight, c.norm_eps, pdl=pdl), None
            return add_rmsnorm(x, delta, weight, c.norm_eps, pdl=pdl, fp8_out=True)

        h, h8 = norm(None, w["l0.attn_norm"], "l0.qkv")
        ahead = self._pf_stream is not None and meta.max_query == 1
        for i in range(c.num_layers):
            p = f"l{i}."
            if ahead:  # this layer's MLP while its attention runs
                self._prefetch((p + "up_gate", p + "down") if self._pf_plan == "mlp" else (p + "up_gate",))
            bias = w.get(p + "qkv.bias")
            qkv = self._proj_lora(h, i, "qkv", masks, bias, x8=h8)
            gemm_bias = bias if qkv.dim() == 3 else None  # split-K partials: the bias is the reader's to add
            if one_kernel:
                a = decode_attention(qkv, self.cos, self.sin, positions, meta.slot_mapping, kv.k[i], kv.v[i], meta,
                                     self.scale, nq, nkv, hd, bias=gemm_bias, block_n=self.decode_block_n, pdl=pdl)
            else:
                q = rope_and_cache(qkv, self.cos, self.sin, positions, meta.slot_mapping, kv.k[i], kv.v[i], nq, nkv,
                                   hd, bias=gemm_bias)
                a = self._triton(q, kv.k[i], kv.v[i], meta, self.scale, block_n=self.decode_block_n)
            nxt = w[f"l{i + 1}.attn_norm"] if i + 1 < c.num_layers else w["final_norm"]
            h, h8 = norm(self._proj_lora(a.view(t, nq * hd), i, "o", masks), w[p + "mlp_norm"], p + "up_gate")
            if ahead:  # the next layer's attention weights while this MLP runs
                nxt_attn = (f"l{i + 1}.qkv", f"l{i + 1}.o") if i + 1 < c.num_layers else ()
                self._prefetch(nxt_attn if self._pf_plan == "mlp" else (p + "down",) + nxt_attn)
            m = self._proj_lora(self._mlp_in(h, i, masks, h8), i, "down", masks)
            h, h8 = norm(m, nxt, f"l{i + 1}.qkv")
        if ahead:  # join the side stream (a captured graph must)
            torch.cuda.current_stream().wait_stream(self._pf_stream)
        return h

    def _prefetch(self, names: tuple[str, ...]) -> None:
        """Fork the side stream from the step's stream here and ask L2 for these weights on it."""
        if not names:
            return
        self._pf_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._pf_stream):
            self._bulk_prefetch([self.w[n] for n in names])

    def _llama(self, ids, positions, kv, meta, masks=None):
        if self.fused:
            return self._llama_fused(ids, positions, kv, meta, masks)
        c, w = self.cfg, self.w
        t = ids.shape[0]
        x = F.embedding(ids, w["embed"])
        hd, nq, nkv = c.head_dim, c.num_heads, c.num_kv_heads
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        qd, kd = nq * hd, nkv * hd
        for i in range(c.num_layers):
            p = f"l{i}."
            h = self._rms(x, w[p + "attn_norm"])
            qkv = self._lin_lora(h, i, "qkv", masks, w.get(p + "qkv.bias"))
            q, k = qkv[:, :qd].view(t, nq, hd), qkv[:, qd:qd + kd].view(t, nkv, hd)
            if c.qk_norm:  # Qwen3: each head's query and key normalized, then rotated
                q, k = self._rms(q, w[p + "q_norm"]), self._rms(k, w[p + "k_norm"])
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            v = qkv[:, qd + kd:].reshape(t, nkv, hd)
            a = self._attend(q.contiguous(), k.contiguous(), v.contiguous(), i, kv, meta).reshape(t, qd)
            x = x + self._lin_lora(a, i, "o", masks, w.get(p + "o.bias"))
            h = self._rms(x, w[p + "mlp_norm"])
            gate, up = self._lin_lora(h, i, "up_gate", masks, w.get(p + "up_gate.bias")).chunk(2, dim=-1)
            x = x + self._lin_lora(F.silu(gate) * up, i, "down", masks, w.get(p + "down.bias"))
        return self._rms(x, w["final_norm"])

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        out = self._lin(hidden, "lm_head")
        return out.float() if upcast else out


class KVCache:
    """K and V of every layer: [layers, blocks, block_size, kv_heads, head_dim] each. The last block
    is scratch space that padded rows of a CUDA-graph batch write into."""

    def __init__(self, cfg: DecoderConfig, num_blocks: int, block_size: int, device, dtype):
        shape = (cfg.num_layers, num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks

    @staticmethod
    def bytes_per_block(cfg: DecoderConfig, block_size: int, dtype) -> int:
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8

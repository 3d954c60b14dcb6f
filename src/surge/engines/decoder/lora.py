"""LoRA adapters on the device: a fixed number of slots, any mix of them in one batch.

Every adaptable module of every layer gets one stacked A [slots * W, in] and one stacked B
[out, slots * W] (W = max rank x the module's parts), slot s holding its adapter in columns
[(s - 1) W, s W) and zeros elsewhere (a rank below the maximum is zero-padded: exact). A step's
rows name their slot (0: the base model). The delta of a module is then two plain GEMMs over all
slots, the first one's columns of other slots zeroed per row:

    delta = ((x A^T) * mask) B^T,   mask[t, c] = (slot of row t == slot of column c)

which is each row's own adapter's term exactly (the other slots contribute exact zeros), needs no
gather or data-dependent loop (CUDA graphs capture it as is), and costs slots x rank columns:
vLLM's default of one slot of rank 16 is 16 columns of extra GEMM per module. Loading an adapter
writes its slot in place, so captured graphs stay valid.

On a GPU in BF16 / FP16, at decode sizes, the deltas are joined inside the module's own GEMM kernel
(split-K or the one-kernel gate/up: x A^T summed in the GEMM's own K loop, the mask built from the
rows' slots in the kernel; kernels/lora_delta.join_deltas) where the module's stacked rank is at most
lora_delta.JOIN_MAX_R columns; other GPU products take them from two Triton kernels (a shrink on a
side stream beside the GEMM, an expand added to its product in place, chunks of slots no row uses
skipped); elsewhere (the CPU, FP32) the torch form above, its masks built once a step.
"""

from __future__ import annotations

import torch

from surge.models.decoder import DecoderConfig
from surge.models.lora import LoraAdapter, in_features, modules_of, part_rows


class LoraBank:
    def __init__(self, cfg: DecoderConfig, slots: int, max_rank: int, device, dtype, kernel: bool | None = None,
                 join: bool = True):
        """kernel: the delta kernels (kernels/lora_delta.py); None: wherever they can run (CUDA, BF16 / FP16,
        Triton); False: the torch form everywhere (measurements). join: with the kernels, the deltas joined
        inside the decode GEMMs' own kernels where those take them; False: always the two delta kernels
        (measurements)."""
        if slots < 1 or max_rank < 1:
            raise ValueError("a LoRA bank needs at least one slot of rank >= 1")
        self.slots, self.max_rank = slots, max_rank
        self.width: dict[str, int] = {m: max_rank * len(parts) for m, parts in modules_of(cfg).items()}
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(cfg.num_layers):
            for module, w in self.width.items():
                self.a[layer, module] = torch.zeros(slots * w, in_features(cfg, module), device=device, dtype=dtype)
                self.b[layer, module] = torch.zeros(sum(part_rows(cfg, module)), slots * w, device=device,
                                                    dtype=dtype)
        # the slot (1-based) each column of a width's stacked rank belongs to
        self._col_slot = {w: torch.arange(slots * w, device=device) // w + 1 for w in set(self.width.values())}
        self.dtype = dtype
        usable = torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16)
        if usable and kernel is not False:
            from surge.engines import kernels

            usable = kernels.available()
        if kernel and not usable:
            raise ValueError("the LoRA kernel needs CUDA, Triton and BF16 / FP16 weights")
        self.kernel = usable and kernel is not False
        self.join = join
        self._side: dict = {}  # device -> the stream the kernels' first halves run on

    def side_stream(self, device) -> torch.cuda.Stream:
        if device not in self._side:
            self._side[device] = torch.cuda.Stream(device)
        return self._side[device]

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Write `adapter` into `slot` (1..slots), replacing what the slot held."""
        if not 1 <= slot <= self.slots or adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter '{adapter.name}' (rank {adapter.rank}) does not fit slot {slot} of "
                             f"1..{self.slots} (rank {self.max_rank}): read_adapter checks the rank")
        self.clear(slot)
        for (layer, module), (a, b) in adapter.weights.items():
            w, r = self.width[module], a.shape[0]
            lo = (slot - 1) * w
            self.a[layer, module][lo:lo + r].copy_(a)
            self.b[layer, module][:, lo:lo + r].copy_(b)

    def clear(self, slot: int) -> None:
        for (_, module), a in self.a.items():
            w = self.width[module]
            lo = (slot - 1) * w
            a[lo:lo + w].zero_()
        for (_, module), b in self.b.items():
            w = self.width[module]
            lo = (slot - 1) * w
            b[:, lo:lo + w].zero_()

    def step(self, adapters: torch.Tensor, pdl: bool = False) -> "LoraStep":
        """One forward's rows: adapters [T] each row's slot (0: the base model)."""
        return LoraStep(self, adapters, pdl)


class LoraStep:
    """The rows' slots of one forward; adds their deltas to the modules' products."""

    def __init__(self, bank: LoraBank, adapters: torch.Tensor, pdl: bool):
        self.bank, self.adapters, self.pdl = bank, adapters, pdl
        self._masks: dict[int, torch.Tensor] | None = None

    def masks(self) -> dict[int, torch.Tensor]:
        """Per width: [T, slots * width] ones where a row's slot owns the column (the torch form's)."""
        if self._masks is None:
            rows = self.adapters.view(-1, 1)
            self._masks = {w: (rows == cols).to(self.bank.dtype) for w, cols in self.bank._col_slot.items()}
        return self._masks

    def operands(self, layer: int, module: str):
        """The module's slots and the rows' slots for a GEMM kernel that joins the deltas itself
        (kernels/lora_delta.LoraOperands), or None where the bank runs the torch form, is told not to
        join, or stacks more than lora_delta.JOIN_MAX_R columns for the module."""
        bank = self.bank
        if not (bank.kernel and bank.join):
            return None
        from surge.engines.kernels.lora_delta import JOIN_MAX_R, LoraOperands

        a = bank.a[layer, module]
        if a.shape[0] > JOIN_MAX_R:  # more slots x rank than a GEMM's registers hold: the two delta kernels
            return None
        return LoraOperands(a, bank.b[layer, module], self.adapters, bank.width[module])

    def begin(self, x: torch.Tensor, layer: int, module: str) -> "PendingDelta":
        """Start a module's delta before its product is computed: with the kernels, x A^T runs on a side
        stream beside the module's own GEMM (off the step's critical path); finish_ adds the rest."""
        bank = self.bank
        a = bank.a[layer, module]
        if not bank.kernel:
            return PendingDelta(self, layer, module, x=x)
        from surge.engines.kernels.lora_delta import lora_shrink

        main = torch.cuda.current_stream(x.device)
        side = bank.side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            # no PDL here: its dependency is the event, not a kernel of its own stream
            ws = lora_shrink(x, a, self.adapters, bank.width[module])
        return PendingDelta(self, layer, module, ws=ws, side=side)


class PendingDelta:
    """A module's delta between LoraStep.begin and the module's product."""

    def __init__(self, step: LoraStep, layer: int, module: str, x=None, ws=None, side=None):
        self.step, self.layer, self.module, self.x, self.ws, self.side = step, layer, module, x, ws, side

    def finish_(self, out: torch.Tensor) -> torch.Tensor:
        """out [T, out_features] (the module's product, or its first FP32 split-K partial) plus each row's
        adapter's delta, in place; returns out."""
        step, bank = self.step, self.step.bank
        b = bank.b[self.layer, self.module]
        if self.ws is None:  # the torch form
            xa = torch.nn.functional.linear(self.x, bank.a[self.layer, self.module]) * step.masks()[
                bank.width[self.module]]
            return out.add_(torch.nn.functional.linear(xa, b))
        from surge.engines.kernels.lora_delta import lora_expand_

        torch.cuda.current_stream(out.device).wait_stream(self.side)
        # ws was allocated on the side stream and may be reused by its next allocation once freed: that is the
        # next module's shrink, which begin() orders after everything queued here (side.wait_stream(main))
        return lora_expand_(out, self.ws, b, step.adapters, bank.width[self.module], pdl=step.pdl)

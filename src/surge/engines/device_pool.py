"""Pooling on the GPU, inside the captured graph (TorchEngine.attach_pooling).

Host pooling of the hidden states cost the engine process a quarter of its samples under load
on the H200 (fp16 -> fp32 conversion of [tokens, hidden] and a segmented sum in numpy, per
batch) and copied [tokens, hidden] back instead of [batch, hidden]. Here the same math runs on
the device: mean pooling as a segmented fp32 sum whose order starts at each sequence's own first
token (kernels/segment_mean.py: a row never depends on its batch-mates or its place in the batch;
a membership-matrix product through cuBLAS summed in an order that did), cls / last as row gathers. Shapes are fixed per bucket, so it is captured with the encoder.
"""

from __future__ import annotations

import torch

DEVICE_POOLING = ("mean", "cls", "last")


def pool_on_device(x: torch.Tensor, inputs: torch.Tensor, key: tuple, mode: str) -> torch.Tensor:
    """[bb, hidden] float32 rows of a bucket's packed hidden states x[:tb]; rows past the batch's
    real sequences (empty: cu_seqlens repeats the token count there) are zeros or junk, never read."""
    bb, tb, _ = key
    cu = inputs[3 * tb:3 * tb + bb + 1].long()
    if mode == "cls":
        return x.index_select(0, cu[:-1].clamp(max=tb - 1)).float()
    if mode == "last":
        return x.index_select(0, (cu[1:] - 1).clamp(min=0, max=tb - 1)).float()
    if mode != "mean":
        raise ValueError(f"pooling {mode!r} is not computed on the device")
    from surge.engines.kernels.segment_mean import segment_mean

    return segment_mean(x[:tb], inputs[3 * tb:3 * tb + bb + 1], bb)

"""The decoder engine: model forward over a paged KV cache, sampling, CUDA-graph decode."""

from surge.engines.decoder.runner import DecoderEngine, SampleOut

__all__ = ["DecoderEngine", "SampleOut"]

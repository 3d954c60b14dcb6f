"""One copy of an encoder's weights per (path, device, dtype), shared by the engine instances that run it
and freed with the last of them (engines/torch_gpu.TorchEngine's load and close).

Apart from torch_gpu.py because it is a process-wide registry, not a part of one engine instance.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from surge.engines.encoder_weights import EncoderWeights, load_weights

# (path, device, dtype) -> [weights, engines using them]: instances of one model share
# weights; the last close() frees them (a reloaded model version must not leak the old one).
_WEIGHTS: dict[tuple, list] = {}
_WEIGHTS_LOCK = threading.Lock()


def _weights_key(path: Path, device: torch.device, dtype: torch.dtype) -> tuple:
    return (str(Path(path).resolve()), str(device), dtype)


def shared_weights(path: Path, device: torch.device, dtype: torch.dtype) -> EncoderWeights:
    """The weights for (path, device, dtype), loaded once; each call takes a reference."""
    key = _weights_key(path, device, dtype)
    with _WEIGHTS_LOCK:
        entry = _WEIGHTS.get(key)
        if entry is None:
            entry = _WEIGHTS[key] = [load_weights(path).to(device, dtype), 0]
        entry[1] += 1
        return entry[0]


def release_weights(path: Path, device: torch.device, dtype: torch.dtype) -> None:
    key = _weights_key(path, device, dtype)
    with _WEIGHTS_LOCK:
        entry = _WEIGHTS.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del _WEIGHTS[key]

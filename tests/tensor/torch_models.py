"""A small two-output CNN exported with torch.export (dynamic batch) for the torch-kind tests."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.export import Dim


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, pixels):
        h = torch.relu(self.bn(self.conv(pixels)))
        return self.fc(h.mean((2, 3))), h.amax((1, 2, 3))


def export_two_heads(path: Path, seed: int = 0, max_batch: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = TwoHeads().eval()
    model.bn.running_mean.uniform_(-0.2, 0.2)
    model.bn.running_var.uniform_(0.5, 1.5)
    program = torch.export.export(model, (torch.randn(2, 3, 16, 16),),
                                  dynamic_shapes={"pixels": {0: Dim("batch", min=1, max=max_batch)}})
    torch.export.save(program, str(path))
    return model

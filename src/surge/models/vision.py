"""Vision test models built in code (torchvision does not import beside this torch build).

- `resnet(...)`: the ResNet of He et al. (bottleneck blocks; `resnet50()` is
  [3, 4, 6, 3] at width 64, 25.6 M parameters), seeded random weights with
  random BatchNorm statistics, so that folding BatchNorm is a real rewrite.
- `SmallCNN` + `shapes_dataset` + `train`: a small residual CNN trained in
  seconds on generated images of four pattern classes, so that top-1 accuracy
  (and top-1 agreement of an optimized graph) means something.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return torch.relu(h + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), width: int = 64, classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for i, n in enumerate(layers):
            w = width * 2 ** i
            for j in range(n):
                blocks.append(Bottleneck(cin, w, 2 if j == 0 and i > 0 else 1))
                cin = w * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, pixels):
        h = self.blocks(self.stem(pixels))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(h, 1), 1))


def randomize_batchnorm(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            c = m.num_features
            m.weight.data = 0.5 + torch.rand(c, generator=g)
            m.bias.data = 0.1 * torch.randn(c, generator=g)
            m.running_mean = 0.1 * torch.randn(c, generator=g)
            m.running_var = 0.5 + torch.rand(c, generator=g)
    return model


def resnet(layers=(3, 4, 6, 3), width: int = 64, classes: int = 1000, seed: int = 0) -> ResNet:
    torch.manual_seed(seed)
    return randomize_batchnorm(ResNet(layers, width, classes), seed).eval()


def resnet50(seed: int = 0) -> ResNet:
    return resnet((3, 4, 6, 3), 64, 1000, seed)


class SmallCNN(nn.Module):
    """conv-bn-relu, a residual conv-bn + add + relu, pool, linear: the patterns the optimizer fuses."""

    def __init__(self, classes: int = 4, width: int = 16):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width)
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, pixels):
        h = torch.relu(self.bn1(self.conv1(pixels)))
        h = torch.relu(self.bn2(self.conv2(h)) + h)
        h = torch.relu(self.bn3(self.conv3(h)))
        return self.fc(h.mean((2, 3)))


CLASSES = ("horizontal", "vertical", "diagonal", "blob")


def shapes_dataset(n: int, size: int = 16, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n images [n, 3, size, size] float32 of four classes: stripes (horizontal, vertical,
    diagonal) at a random frequency and phase, or a Gaussian blob at a random place;
    random colours and noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    images = np.empty((n, 3, size, size), np.float32)
    labels = rng.integers(0, len(CLASSES), n)
    for i, c in enumerate(labels):
        freq, phase = rng.uniform(0.4, 1.2), rng.uniform(0, 2 * np.pi)
        if c == 0:
            pattern = np.sin(freq * yy + phase)
        elif c == 1:
            pattern = np.sin(freq * xx + phase)
        elif c == 2:
            pattern = np.sin(freq * (xx + yy) / 1.4 + phase)
        else:
            cy, cx, r = rng.uniform(3, size - 3), rng.uniform(3, size - 3), rng.uniform(2, 4)
            pattern = 2 * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r)) - 1
        colour = rng.uniform(0.3, 1.0, 3).astype(np.float32)
        images[i] = colour[:, None, None] * pattern + rng.normal(0, 0.3, (3, size, size))
    return images, labels


def train(model: nn.Module, images: np.ndarray, labels: np.ndarray, epochs: int = 4, seed: int = 0) -> nn.Module:
    """A few epochs of Adam (seconds on two cores); returns the model in eval mode."""
    torch.manual_seed(seed)
    x, y = torch.from_numpy(images), torch.from_numpy(labels)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(x))
        for i in range(0, len(x), 64):
            idx = perm[i:i + 64]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def export_onnx(model: nn.Module, path, size: int, opset: int = 17) -> None:
    """The raw export: dynamic batch, BatchNorm kept as its own node (no exporter folding)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 3, size, size),), str(path), dynamo=False, opset_version=opset,
                          input_names=["pixels"], output_names=["logits"], do_constant_folding=False,
                          dynamic_axes={"pixels": {0: "N"}, "logits": {0: "N"}})

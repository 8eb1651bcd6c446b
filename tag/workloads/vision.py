"""Small classifiers written from scratch (no torchvision / timm): MLP, ResNet, VGG.

Every model's ``forward(x, y)`` returns the mean cross-entropy loss (a 0-dim float tensor) for
images ``x: [B, 3, H, W]`` (float) or features ``x: [B, in_dim]`` and labels ``y: [B]`` (int64).
No dropout anywhere, and no Python control flow on tensor values (so ``torch.export`` works).

BatchNorm computes statistics across the batch, so a batch split into micro-batches does NOT give
the same loss/gradients as the full batch; use ``norm="gn"`` or ``norm="none"`` (ResNet) or
``bn=False`` (VGG) where split-batch equality matters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import nn

NORMS = ("bn", "gn", "none")
RESNET_LAYOUTS: Mapping[int, tuple[str, tuple[int, ...]]] = MappingProxyType({
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
    152: ("bottleneck", (3, 8, 36, 3)),
})
VGG_LAYOUTS: Mapping[int, tuple[int | str, ...]] = MappingProxyType({
    11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    13: (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    16: (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    19: (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
         512, 512, 512, 512, "M"),
})


class MLP(nn.Module):
    """``layers`` hidden Linear+ReLU layers of width ``hidden``, then a Linear to ``classes`` logits."""

    def __init__(self, in_dim: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * layers
        blocks: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:]):
            blocks += [nn.Linear(a, b), nn.ReLU()]
        blocks.append(nn.Linear(dims[-1], classes))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x: [B, in_dim] float, y: [B] int64 -> scalar mean cross-entropy."""
        return F.cross_entropy(self.net(x), y)


def _norm(kind: str, channels: int) -> nn.Module:
    """A 2-D normalisation layer: BatchNorm, GroupNorm (gcd(channels, 32) groups) or identity."""
    if kind == "bn":
        return nn.BatchNorm2d(channels)
    if kind == "gn":
        return nn.GroupNorm(math.gcd(channels, 32), channels)
    return nn.Identity()


def _conv(cin: int, cout: int, k: int, stride: int, norm: str) -> nn.Conv2d:
    """k x k conv with 'same' padding; bias only when there is no normalisation after it."""
    return nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=norm == "none")


class BasicBlock(nn.Module):
    """ResNet-18/34 block: two 3x3 convs plus a (projected when shape changes) shortcut."""

    expansion = 1

    def __init__(self, cin: int, c: int, stride: int, norm: str) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _conv(cin, c, 3, stride, norm), _norm(norm, c), nn.ReLU(),
            _conv(c, c, 3, 1, norm), _norm(norm, c),
        )
        self.shortcut = _shortcut(cin, c, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


class Bottleneck(nn.Module):
    """ResNet-50/101 block: 1x1 reduce, 3x3 (strided), 1x1 expand to ``4 * c`` channels."""

    expansion = 4

    def __init__(self, cin: int, c: int, stride: int, norm: str) -> None:
        super().__init__()
        cout = c * self.expansion
        self.body = nn.Sequential(
            _conv(cin, c, 1, 1, norm), _norm(norm, c), nn.ReLU(),
            _conv(c, c, 3, stride, norm), _norm(norm, c), nn.ReLU(),
            _conv(c, cout, 1, 1, norm), _norm(norm, cout),
        )
        self.shortcut = _shortcut(cin, cout, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def _shortcut(cin: int, cout: int, stride: int, norm: str) -> nn.Module:
    if stride == 1 and cin == cout:
        return nn.Identity()
    return nn.Sequential(_conv(cin, cout, 1, stride, norm), _norm(norm, cout))


class ResNet(nn.Module):
    """ResNet of ``depth`` 18/34/50/101/152 with stage widths ``width * (1, 2, 4, 8)``.

    Images smaller than 128 px use a CIFAR stem (3x3 conv, stride 1); larger ones the ImageNet stem
    (7x7 conv stride 2 + 3x3 max-pool). Stages 2-4 halve the resolution; then global average pool
    and a Linear classifier.
    """

    def __init__(self, depth: int, width: int, image: int, classes: int, norm: str = "bn") -> None:
        super().__init__()
        kind, counts = RESNET_LAYOUTS[depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        if image < 128:
            self.stem = nn.Sequential(_conv(3, width, 3, 1, norm), _norm(norm, width), nn.ReLU())
        else:
            self.stem = nn.Sequential(
                _conv(3, width, 7, 2, norm), _norm(norm, width), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
            )
        stages: list[nn.Module] = []
        cin = width
        for i, n in enumerate(counts):
            c = width * 2**i
            blocks = []
            for j in range(n):
                blocks.append(block(cin, c, 2 if (i > 0 and j == 0) else 1, norm))
                cin = c * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x: [B, 3, image, image] float, y: [B] int64 -> scalar mean cross-entropy."""
        h = self.stages(self.stem(x))
        return F.cross_entropy(self.fc(h.mean(dim=(2, 3))), y)


class VGG(nn.Module):
    """VGG-``depth`` (11/13/16/19); conv widths are the paper's scaled by ``width / 64``.

    Five 2x2 max-pools reduce ``image`` (a multiple of 32) by 32; the classifier is
    Linear(8 * width * (image/32)^2 -> hidden) -> ReLU -> Linear(hidden -> hidden) -> ReLU -> Linear.
    """

    def __init__(self, depth: int, width: int, image: int, classes: int, hidden: int,
                 bn: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for v in VGG_LAYOUTS[depth]:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
                continue
            c = max(1, int(v) * width // 64)
            layers += [_conv(cin, c, 3, 1, "bn" if bn else "none"), _norm("bn" if bn else "none", c),
                       nn.ReLU()]
            cin = c
        self.features = nn.Sequential(*layers)
        side = image // 32
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(cin * side * side, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x: [B, 3, image, image] float, y: [B] int64 -> scalar mean cross-entropy."""
        return F.cross_entropy(self.classifier(self.features(x)), y)

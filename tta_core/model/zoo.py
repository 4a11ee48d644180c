"""Model zoo: the architectures tta adapts, built without any download.

torchvision models are built with random weights (no hub access at run time); trained
weights come from checkpoints made by `tta train-source` or supplied by the user.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchvision import models as tvm


class BasicBlock(nn.Module):
    """Pre-activation-free CIFAR ResNet basic block (He et al. 2016, option B shortcut)."""

    def __init__(self, in_ch: int, out_ch: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=False)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        # the shortcut runs after the main branch, as in torchvision: units are ordered by
        # execution, and the planner's chain cost (DESIGN §3) charges every unit after the
        # deepest selected one; a shortcut first would charge the whole main branch's ∂x to a
        # downsample-only plan, which autograd never computes
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class SmallResNet(nn.Module):
    """A small CIFAR-style ResNet (3 stages x `blocks` basic blocks) for 32/64 px inputs.

    Attribute names follow torchvision's ResNet (conv1, bn1, layerN, fc) so the same unit
    decomposition and stage logic apply to both.
    """

    def __init__(self, num_classes: int = 16, width: int = 16, blocks: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=False)
        self.layer1 = self._stage(width, width, blocks, 1)
        self.layer2 = self._stage(width, 2 * width, blocks, 2)
        self.layer3 = self._stage(2 * width, 4 * width, blocks, 2)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4 * width, num_classes)

    @staticmethod
    def _stage(in_ch: int, out_ch: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [BasicBlock(in_ch, out_ch, stride)]
        layers += [BasicBlock(out_ch, out_ch, 1) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "small_resnet": lambda n: SmallResNet(num_classes=n),
    "resnet18": lambda n: tvm.resnet18(weights=None, num_classes=n),
    "resnet50": lambda n: tvm.resnet50(weights=None, num_classes=n),
    "mobilenet_v2": lambda n: tvm.mobilenet_v2(weights=None, num_classes=n),
    "vit_b_16": lambda n: tvm.vit_b_16(weights=None, num_classes=n),
}

ARCHS: tuple[str, ...] = tuple(_BUILDERS)


def build_model(arch: str, num_classes: int) -> nn.Module:
    """Build `arch` with random weights and `num_classes` outputs."""
    if arch not in _BUILDERS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    return _BUILDERS[arch](num_classes)

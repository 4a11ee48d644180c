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
    """A CIFAR-style ResNet (3x3 stem, no max-pool) for 32-96 px inputs.

    `blocks` gives the basic blocks per stage (an int: three stages of that many); stage s
    has `width * 2**s` channels and stride 2 from the second stage on. The defaults are
    the shipped small net (16-32-64, one block each); `blocks=(2, 2, 2, 2)` is the CIFAR
    ResNet-18 of He et al. 2016 / Kuang Liu's pytorch-cifar (width 64 there). Attribute
    names follow torchvision's ResNet (conv1, bn1, layerN, fc) so the same unit
    decomposition and stage logic apply to both.
    """

    def __init__(self, num_classes: int = 16, width: int = 16,
                 blocks: int | tuple[int, ...] = 1) -> None:
        super().__init__()
        per_stage = (blocks,) * 3 if isinstance(blocks, int) else tuple(blocks)
        if not 1 <= len(per_stage) <= 4 or min(per_stage) < 1 or width < 1:
            raise ValueError(f"need 1-4 stages of >= 1 block and width >= 1, got "
                             f"blocks={blocks}, width={width}")
        self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=False)
        ch = width
        for s, n in enumerate(per_stage):
            out = width * 2 ** s
            setattr(self, f"layer{s + 1}", self._stage(ch, out, n, 1 if s == 0 else 2))
            ch = out
        self.n_stages = len(per_stage)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(ch, num_classes)

    @staticmethod
    def _stage(in_ch: int, out_ch: int, blocks: int, stride: int) -> nn.Sequential:
        layers = [BasicBlock(in_ch, out_ch, stride)]
        layers += [BasicBlock(out_ch, out_ch, 1) for _ in range(blocks - 1)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        for s in range(self.n_stages):
            x = getattr(self, f"layer{s + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18_cifar(num_classes: int, width: int = 64) -> SmallResNet:
    """CIFAR ResNet-18: 3x3 stem, no max-pool, 4 stages x 2 basic blocks, `width` base
    channels (64 = the full net, 11.2 M parameters; 32 = a quarter of them, 2.8 M)."""
    return SmallResNet(num_classes=num_classes, width=width, blocks=(2, 2, 2, 2))


def resnet26_cifar(num_classes: int, width: int = 16) -> SmallResNet:
    """CIFAR ResNet-26 (He et al. 2016's 6n+2 family, n = 4): 3x3 stem, 3 stages x 4 basic
    blocks of 16-32-64 channels, 0.37 M parameters; the CIFAR-scale benchmark's source net."""
    return SmallResNet(num_classes=num_classes, width=width, blocks=4)


_BUILDERS: dict[str, Callable[[int], nn.Module]] = {
    "small_resnet": lambda n: SmallResNet(num_classes=n),
    "resnet26_cifar": lambda n: resnet26_cifar(n),
    "resnet18_cifar": lambda n: resnet18_cifar(n, width=64),
    "resnet18_cifar_w32": lambda n: resnet18_cifar(n, width=32),
    "resnet18_cifar_w16": lambda n: resnet18_cifar(n, width=16),
    "resnet18": lambda n: tvm.resnet18(weights=None, num_classes=n),
    "resnet50": lambda n: tvm.resnet50(weights=None, num_classes=n),
    "mobilenet_v2": lambda n: tvm.mobilenet_v2(weights=None, num_classes=n),
    "vit_b_16": lambda n: tvm.vit_b_16(weights=None, num_classes=n),
}

ARCHS: tuple[str, ...] = tuple(_BUILDERS)


class SegmentationNet(nn.Module):
    """A torchvision segmentation model whose forward returns the N x C x H x W logits
    (torchvision's models return a dict holding them under "out")."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)["out"]


def _segmentation(name: str) -> Callable[[int], nn.Module]:
    def build(n: int) -> nn.Module:
        return SegmentationNet(getattr(tvm.segmentation, name)(
            weights=None, weights_backbone=None, num_classes=n))
    return build


# semantic segmentation nets (random backbone too: no ImageNet download)
SEG_ARCHS: tuple[str, ...] = ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large",
                              "deeplabv3_resnet50")
_SEG_BUILDERS: dict[str, Callable[[int], nn.Module]] = {a: _segmentation(a) for a in SEG_ARCHS}


def build_model(arch: str, num_classes: int) -> nn.Module:
    """Build `arch` (a classifier of ARCHS or a segmentation net of SEG_ARCHS) with random
    weights and `num_classes` outputs."""
    builders = _BUILDERS | _SEG_BUILDERS
    if arch not in builders:
        raise ValueError(f"unknown arch {arch!r}; choose one of "
                         f"{', '.join(ARCHS + SEG_ARCHS)}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    return builders[arch](num_classes)

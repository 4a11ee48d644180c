"""Choices that several `tta` commands offer, copied from the modules that define them
(those import torch: tta_core.model.zoo, tta_core.adashadow.profiler) so that
`tta <cmd> --help` stays fast. test/system/test_cli_fast.py checks that they are equal.
"""

from __future__ import annotations

# tta_core.model.zoo.ARCHS: the zoo's architectures, in its order
ARCHS: tuple[str, ...] = ("small_resnet", "resnet26_cifar", "resnet18_cifar", "resnet18_cifar_w32",
                          "resnet18_cifar_w16", "resnet18", "resnet50", "mobilenet_v2",
                          "vit_b_16")
# tta_core.model.zoo.SEG_ARCHS: the zoo's segmentation nets
SEG_ARCHS: tuple[str, ...] = ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large",
                              "deeplabv3_resnet50")
# tta_core.adashadow.profiler.SPLITS: how a unit's backward divides into dw and dx
SPLITS: tuple[str, ...] = ("macs", "plans")

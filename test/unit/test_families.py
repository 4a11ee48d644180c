"""Every registered method against the torchvision families users bring (random weights,
10 classes, 64 px, batch 2): it builds and steps, or it refuses at build time in one line
naming what the model lacks.

Which combinations run by default: every method on mobilenet_v3_small (the quickest
family) and the refusals on convnext_tiny (LayerNorm only); the rest is marked slow."""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
from torch import nn
from torchvision import models as tvm

from tta_core.registry import available_methods, build_method

FAMILIES = ("convnext_tiny", "mobilenet_v3_small", "efficientnet_b0", "regnet_x_400mf",
            "regnet_y_400mf", "shufflenet_v2_x0_5", "mobilenet_v2", "resnet18")
CLASS = {"convnext_tiny": "ConvNeXt", "mobilenet_v3_small": "MobileNetV3",
         "efficientnet_b0": "EfficientNet", "regnet_x_400mf": "RegNet", "regnet_y_400mf": "RegNet",
         "shufflenet_v2_x0_5": "ShuffleNetV2", "mobilenet_v2": "MobileNetV2",
         "resnet18": "ResNet"}
QUICK = ("mobilenet_v3_small",)


def refusal(method: str, family: str) -> str | None:
    """The one-line refusal `method` gives on `family` at build time, or None (it serves)."""
    cls = CLASS[family]
    if method == "elastic":  # needs its own gated master (`tta train-elastic`)
        return (f"elastic: {cls} is not a gated master; make one with `tta train-elastic` "
                "and pass its model card")
    if family == "convnext_tiny" and method == "bn_adapt":
        return ("bn_adapt needs BatchNorm layers; ConvNeXt has none (its norms: "
                "LayerNorm2d \N{MULTIPLICATION SIGN}5, LayerNorm \N{MULTIPLICATION SIGN}18)")
    if family == "convnext_tiny" and method == "darda":
        return "embedding wants 3 BatchNorm layers, ConvNeXt has 0"
    return None


@functools.cache
def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return getattr(tvm, family)(weights=None, num_classes=10)


def _cases() -> list:
    cases = []
    for family in FAMILIES:
        for method in available_methods():
            marks = []
            quick = family in QUICK or (family == "convnext_tiny"
                                        and refusal(method, family) is not None)
            if not quick:
                marks.append(pytest.mark.slow)
            cases.append(pytest.param(method, family, marks=marks, id=f"{method}-{family}"))
    return cases


@pytest.mark.parametrize("method,family", _cases())
def test_method_serves_the_family_or_refuses_in_one_line(method: str, family: str,
                                                         one_thread) -> None:
    model = copy.deepcopy(_model(family))
    expected = refusal(method, family)
    if expected is not None:
        with pytest.raises(ValueError) as exc:
            build_method(method, model, input_shape=(3, 64, 64))
        assert str(exc.value) == expected
        return
    m = build_method(method, model, input_shape=(3, 64, 64))
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    res = m.step(x)
    m.finish()
    assert res.logits.shape == (2, 10) and bool(torch.isfinite(res.logits).all())


def test_the_bn_refusal_counts_the_model_s_norms() -> None:
    """A model with no normalisation at all says so."""
    with pytest.raises(ValueError, match=re.escape(
            "bn_adapt needs BatchNorm layers; Sequential has none (no normalisation layers)")):
        build_method("bn_adapt", nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(),
                                               nn.Linear(4 * 6 * 6, 10)), input_shape=(3, 8, 8))

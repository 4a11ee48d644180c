"""Model zoo: the CIFAR ResNet-18 family (parameter counts, MACs, unit decomposition)."""

from __future__ import annotations

import pytest
import torch

from tta_core.model.units import decompose
from tta_core.model.zoo import ARCHS, SmallResNet, build_model

CIFAR18 = {"resnet18_cifar": 64, "resnet18_cifar_w32": 32, "resnet18_cifar_w16": 16}


def _conv_macs(width: int, size: int, classes: int) -> int:
    """Weight MACs per sample of a CIFAR ResNet-18 (3x3 stem, 4 stages x 2 blocks), by hand."""
    total = 9 * 3 * width * size * size  # stem, stride 1
    c_in = width
    for s in range(4):
        c, h = width * 2 ** s, size // 2 ** s
        total += 9 * c_in * c * h * h + 3 * 9 * c * c * h * h  # block 0 conv1; the rest
        if c_in != c:
            total += c_in * c * h * h  # 1x1 downsample
        c_in = c
    return total + 8 * width * classes  # fc


def _params(width: int, classes: int) -> int:
    """Parameter count of the same net, by hand (bias-free convs; BN weight + bias)."""
    total, c_in = 27 * width + 2 * width, width
    for s in range(4):
        c = width * 2 ** s
        total += 9 * c_in * c + 3 * 9 * c * c + 4 * 2 * c
        if c_in != c:
            total += c_in * c + 2 * c
        c_in = c
    return total + 8 * width * classes + classes


def test_cifar_resnet18_archs_are_registered() -> None:
    assert set(CIFAR18) <= set(ARCHS)
    assert "small_resnet" in ARCHS


@pytest.mark.parametrize("arch,width", sorted(CIFAR18.items()))
def test_cifar_resnet18_parameters(arch: str, width: int) -> None:
    model = build_model(arch, 22)
    assert isinstance(model, SmallResNet)
    assert sum(p.numel() for p in model.parameters()) == _params(width, 22)
    assert [n for n, _ in model.named_children()][:7] == [
        "conv1", "bn1", "relu", "layer1", "layer2", "layer3", "layer4"]
    assert model.conv1.kernel_size == (3, 3) and not hasattr(model, "maxpool")


def test_full_width_matches_the_published_cifar_resnet18() -> None:
    """11.17 M parameters and 0.56 GMACs at 32 px with 10 classes (kuangliu/pytorch-cifar)."""
    model = build_model("resnet18_cifar", 10)
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
    staged = decompose(model, (3, 32, 32), "resnet18_cifar")
    macs = sum(u.macs_fwd for u in staged.units if u.kind in ("conv", "linear"))
    assert macs == _conv_macs(64, 32, 10) and 0.55e9 < macs < 0.56e9


@pytest.mark.parametrize("size", [64, 96])
def test_w32_decomposes_like_torchvision_resnet18(size: int) -> None:
    torch.manual_seed(0)
    model = build_model("resnet18_cifar_w32", 22)
    staged = decompose(model, (3, size, size), "resnet18_cifar_w32")
    names = [u.name for u in staged.units]
    # conv1+bn1, 8 blocks x (conv, bn, conv, bn), 3 downsamples x (conv, bn), fc
    assert len(names) == 41 and names[0] == "conv1" and names[-1] == "fc"
    assert [s.name for s in staged.stages] == [
        "stem", *(f"layer{s}.{b}" for s in range(1, 5) for b in range(2)), "head"]
    assert names.index("layer2.0.bn2") < names.index("layer2.0.downsample.0")
    assert sum(u.params for u in staged.units) == _params(32, 22)
    macs = sum(u.macs_fwd for u in staged.units if u.kind in ("conv", "linear"))
    assert macs == _conv_macs(32, size, 22)
    # every stage's 3x3 convs cost about the same: the per-unit costs the planner trades
    convs = [u.macs_fwd for u in staged.units if u.kind == "conv" and "downsample" not in u.name]
    assert max(convs[1:]) / min(convs[2:]) < 2.01
    model.eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert torch.equal(staged.forward_from(0, x), model(x))
        h = x
        for st in staged.stages[:5]:  # restart mid-net (layer3.0) from its cached input
            h = st.module(h)
        assert torch.equal(staged.forward_from(5, h), model(x))


def test_wrong_arch_name_for_the_model_is_refused() -> None:
    with pytest.raises(ValueError, match="does not match"):
        decompose(build_model("resnet18_cifar_w16", 10), (3, 32, 32), "mobilenet_v2")


def test_bad_small_resnet_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="1-4 stages"):
        SmallResNet(blocks=(2, 2, 2, 2, 2))
    with pytest.raises(ValueError, match="1-4 stages"):
        SmallResNet(blocks=0)

"""DAF quantized saves in the activation codec (tta_core.memory.quant): gradient fidelity at
8/4/2 bits with exact ReLU masks on the shipped net and ResNet-18, measured bytes equal to
the predictor's, 0 bits exact for frozen units and refused for trainable ones, plan checks."""

from __future__ import annotations

import pytest
import torch
from helpers.models import MODELS, cosine, entropy, flat_grads, resnet18_64px, shipped_net
from torch import nn

from tta_core.memory import (
    ActivationCodec,
    CodecPlan,
    SavedActivationCounter,
    predicted_bytes,
    profile_saves,
)
from tta_core.memory.quant import PackedQuant, quant_nbytes
from tta_core.model.norms import NORM_TYPES

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["shipped", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_gradient_cosine_at_8_and_4_bits_with_masks(name: str) -> None:
    """Every conv/linear input and every BN input quantized (masks exact): all gradients."""
    model, x = MODELS[name]()
    exact = flat_grads(model, x)
    cos = {}
    for bits in (8, 4, 2):
        codec = ActivationCodec(model, CodecPlan(default_bits=bits, norm_bits=bits))
        cos[bits] = cosine(exact, flat_grads(model, x, codec))
    assert cos[8] >= 0.999 and cos[4] >= 0.99, cos
    assert cos[8] > cos[4] > cos[2], cos


@pytest.mark.parametrize("plan", [
    CodecPlan(default_bits=4),
    CodecPlan(default_bits=4, norm_bits=8),
    CodecPlan(default_bits=2, norm_bits=2, group=64, act_masks=False),
    CodecPlan(default_bits=4, norm_bits=4, narrow_ints=True),
    CodecPlan({"layer1.0.conv1": 0.3}, default="dense", bits={"fc": 8, "layer4.1.conv2": 2},
              norm_bits=4),
])
def test_measured_bytes_equal_prediction(plan: CodecPlan) -> None:
    model, x = resnet18_64px()
    profile = profile_saves(model, x, entropy)
    codec = ActivationCodec(model, plan)
    with codec:
        entropy(model(x))
    predicted = predicted_bytes(profile, plan)
    if plan.keep:  # a pruned input's kept count is estimated (sampled threshold)
        assert abs(codec.result.total - predicted.total) <= 0.01 * predicted.total
    else:  # quantized sizes are exact
        assert codec.result.total == predicted.total
        assert codec.result.per_unit == predicted.per_unit
    counter = SavedActivationCounter(model)
    with counter:
        entropy(model(x))
    assert codec.result.total < 0.8 * counter.result.total


def test_quantized_bytes_are_codes_plus_group_metadata() -> None:
    t = torch.randn(4, 16, 9, 9).to(memory_format=torch.channels_last)
    for bits in (2, 4, 8):
        p = PackedQuant.encode(t, bits, 128)
        assert p.nbytes == quant_nbytes(t.numel(), bits, 128)
        assert p.nbytes <= t.numel() * bits / 8 + 8 * (t.numel() / 128 + 1) + 128
        back = p.decode()
        assert back.shape == t.shape and back.stride() == t.stride()
        assert float((back - t).abs().max()) <= float(t.max() - t.min()) / (2**bits - 1)


def test_narrow_ints_hold_max_pool_indices_losslessly() -> None:
    """ResNet's max-pool indices (int64, < H*W) as int16: 4x fewer bytes, same gradients."""
    model, x = resnet18_64px()
    exact = flat_grads(model, x)
    masks = ActivationCodec(model, CodecPlan())
    assert torch.equal(flat_grads(model, x, masks), exact)
    narrow = ActivationCodec(model, CodecPlan(narrow_ints=True))
    assert torch.equal(flat_grads(model, x, narrow), exact)
    indices = 8 * 64 * 16 * 16 * 8  # batch x channels x 16 x 16 pooled, int64
    assert masks.result.total - narrow.result.total == indices - indices // 4


def _freeze_convs(model: nn.Module) -> list[str]:
    names = []
    for n, m in model.named_modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            m.requires_grad_(False)
            names.append(n)
    return names


def test_zero_bits_on_frozen_units_keeps_gradients_bit_identical() -> None:
    model, x = resnet18_64px()
    convs = _freeze_convs(model)
    exact = flat_grads(model, x)
    codec = ActivationCodec(model, CodecPlan(bits=dict.fromkeys(convs, 0)))
    got = flat_grads(model, x, codec)
    assert torch.equal(exact, got)
    masks_only = ActivationCodec(model, CodecPlan())
    flat_grads(model, x, masks_only)
    assert codec.result.by_role["wgrad"] == 0
    assert codec.result.total < masks_only.result.total


def test_zero_bits_refused_for_trainable_or_norm_units() -> None:
    model, x = resnet18_64px()
    with pytest.raises(ValueError, match=r"'layer1\.0\.conv1' has 0 bits but its parameters"):
        with ActivationCodec(model, CodecPlan(bits={"layer1.0.conv1": 0})):
            model(x)
    with pytest.raises(ValueError, match=r"'bn1' \(bn\) cannot have 0 bits"):
        with ActivationCodec(model, CodecPlan(bits={"bn1": 0})):
            model(x)


def test_norm_bits_8_keeps_bn_affine_gradients() -> None:
    """Tent's case: convs frozen (inputs dropped), BN inputs at 8 bits."""
    model, x = shipped_net()
    convs = _freeze_convs(model)
    assert any(isinstance(m, NORM_TYPES) for m in model.modules())
    exact = flat_grads(model, x)
    codec = ActivationCodec(model, CodecPlan(bits=dict.fromkeys(convs, 0), norm_bits=8))
    assert cosine(exact, flat_grads(model, x, codec)) >= 0.9999
    counter = SavedActivationCounter(model)
    flat_grads(model, x, counter)
    assert codec.result.total < 0.4 * counter.result.total


@pytest.mark.parametrize(("kwargs", "bad"), [
    ({"bits": {"fc": 3}}, "bit width for unit 'fc' must be one of"),
    ({"default_bits": 16}, "bit width for unit '<default_bits>'"),
    ({"norm_bits": 0}, "bit width for unit '<norm_bits>' must be one of (2, 4, 8)"),
    ({"group": 12}, "group must be a positive multiple of 8"),
])
def test_plan_rejects_bad_widths(kwargs: dict, bad: str) -> None:
    with pytest.raises(ValueError, match=bad.replace("(", r"\(").replace(")", r"\)")):
        CodecPlan(**kwargs)


def test_codec_rejects_bits_for_unknown_units() -> None:
    model, _ = resnet18_64px()
    with pytest.raises(ValueError, match="plan names units the model does not have"):
        ActivationCodec(model, CodecPlan(bits={"nope": 4}))

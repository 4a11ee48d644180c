"""`activation_bits` (DAF) for tent and surgeon: the adaptation forward runs under the codec
with quantized saves; gradients match the dense method's (cosine >= 0.999 at 8 bits,
>= 0.99 at 4 bits) on the shipped net and ResNet-18 at 64 px, with far fewer saved bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from test_memory_quant import MODELS, _entropy
from torch import nn

from tta_core.memory import (
    ActivationCodec,
    CodecPlan,
    SavedActivationCounter,
    predicted_bytes,
    profile_saves,
)
from tta_core.memory.daf import budget_plan, daf_plan, trainable_units
from tta_core.methods import build_method

pytestmark = pytest.mark.usefixtures("one_thread")


def _step_grads(name: str, model: nn.Module, x: torch.Tensor, **cfg) -> tuple[torch.Tensor,
                                                                              dict]:
    """One adaptation step at lr 0 (weights unchanged): the gradient it computed, stats."""
    meth = build_method(name, copy.deepcopy(model), lr=0.0, lr_ref_batch=0, reforward=False,
                        **cfg)
    res = meth.forward_and_adapt(x)
    grads = [p.grad.double().flatten() for p in meth.params if p.grad is not None]
    return torch.cat(grads), res.stats


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("model_name", MODELS)
def test_tent_activation_bits_keeps_the_gradient(model_name: str) -> None:
    model, x = MODELS[model_name]()
    dense, _ = _step_grads("tent", model, x)
    counter = SavedActivationCounter(model)
    with counter, torch.enable_grad():
        model(x)
    cos, saved = {}, {}
    for bits in (8, 4):
        g, stats = _step_grads("tent", model, x, activation_bits=bits)
        cos[bits], saved[bits] = _cos(dense, g), stats["saved_bytes"]
    assert cos[8] >= 0.999 and cos[4] >= 0.99, cos
    # frozen convs store nothing, BN inputs at 8 / 4 bits + masks: well under dense
    assert saved[4] < saved[8] < 0.4 * counter.result.total, (saved, counter.result.total)


def test_surgeon_activation_bits_quantizes_what_it_keeps_dense() -> None:
    model, x = MODELS["shipped"]()
    dense, dense_stats = _step_grads("surgeon", model, x, mode="robot")
    g, stats = _step_grads("surgeon", model, x, mode="robot", activation_bits=8)
    assert _cos(dense, g) >= 0.999
    assert stats["saved_bytes"] < 0.5 * dense_stats["saved_bytes"]


@pytest.mark.parametrize("frac", (0.25, 0.5, 0.9))
def test_budget_plan_stays_within_its_memory_budget(frac: float) -> None:
    """Greedy widths between 'all convs dropped' and 'all at 8 bits': the measured saved
    bytes of the forward (units given 0 bits frozen) never exceed the budget."""
    model, x = MODELS["resnet18"]()
    units, _ = trainable_units(model)
    profile = profile_saves(model, x, _entropy)
    low = predicted_bytes(profile, CodecPlan(bits=dict.fromkeys(units, 0), norm_bits=8,
                                             narrow_ints=True)).total
    high = predicted_bytes(profile, CodecPlan(default_bits=8, norm_bits=8,
                                              narrow_ints=True)).total
    budget = low + frac * (high - low)
    importance = {u: 1.0 + i % 3 for i, u in enumerate(units)}
    plan, alloc = budget_plan(profile, importance, budget)
    for u, b in alloc.bits.items():
        if b == 0:
            dict(model.named_modules())[u].requires_grad_(False)
    codec = ActivationCodec(model, plan)
    with codec, torch.enable_grad():
        _entropy(model(x)).backward()
    assert codec.result.total <= budget
    assert codec.result.total >= budget - 0.2 * (high - low)  # the budget is used
    assert len(set(alloc.bits.values())) > 1


def test_daf_plan_drops_exactly_the_frozen_layers() -> None:
    model, _ = MODELS["resnet18"]()
    model.requires_grad_(False)
    model.fc.requires_grad_(True)
    trainable, frozen = trainable_units(model)
    assert trainable == ["fc"] and "conv1" in frozen
    plan = daf_plan(model, 4)
    assert plan.bits["fc"] == 4 and plan.bits["conv1"] == 0 and plan.norm_bits == 4


@pytest.mark.parametrize("bits", (0, 3, 16, True))
def test_activation_bits_must_be_8_4_or_2(bits: object) -> None:
    model, _ = MODELS["shipped"]()
    with pytest.raises(ValueError, match="bit width for unit '<activation_bits>'"):
        build_method("tent", model, activation_bits=bits)
    with pytest.raises(ValueError, match="bit width for unit '<activation_bits>'"):
        build_method("surgeon", model, activation_bits=bits)

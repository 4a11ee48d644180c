"""`activation_bits` (DAF) for tent and surgeon: the adaptation forward runs under the codec
with quantized saves; gradients match the dense method's (cosine >= 0.999 at 8 bits,
>= 0.99 at 4 bits) on the shipped net and ResNet-18 at 64 px, with far fewer saved bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from test_memory_quant import MODELS
from torch import nn

from tta_core.memory import SavedActivationCounter
from tta_core.memory.daf import daf_plan, trainable_units
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

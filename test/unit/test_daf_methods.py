"""`activation_bits` (DAF) for tent and surgeon: the adaptation forward runs under the codec
with quantized saves; gradients match the dense method's (cosine >= 0.999 at 8 bits,
>= 0.99 at 4 bits) on the shipped net and ResNet-18 at 64 px, with far fewer saved bytes.
`activation_budget_mb` alone: dynamic widths per batch that hold the budget and follow a
change made on the config."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers.models import MODELS, cosine, entropy
from torch import nn

from tta_core.api import Plan
from tta_core.daf.plans import budget_plan
from tta_core.memory import (
    ActivationCodec,
    CodecPlan,
    SavedActivationCounter,
    predicted_bytes,
    profile_saves,
)
from tta_core.memory.widths import daf_plan, trainable_units
from tta_core.methods.tent import Tent, TentConfig
from tta_core.registry import build_method

pytestmark = pytest.mark.usefixtures("one_thread")


def _step_grads(name: str, model: nn.Module, x: torch.Tensor, **cfg) -> tuple[torch.Tensor,
                                                                              dict]:
    """One adaptation step at lr 0 (weights unchanged): the gradient it computed, stats."""
    meth = build_method(name, copy.deepcopy(model), lr=0.0, lr_ref_batch=0, reforward=False,
                        **cfg)
    res = meth.forward_and_adapt(x)
    grads = [p.grad.double().flatten() for p in meth.params if p.grad is not None]
    return torch.cat(grads), res.stats


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
        cos[bits], saved[bits] = cosine(dense, g), stats["saved_bytes"]
    assert cos[8] >= 0.999 and cos[4] >= 0.99, cos
    # frozen convs store nothing, BN inputs at 8 / 4 bits + masks: well under dense
    assert saved[4] < saved[8] < 0.4 * counter.result.total, (saved, counter.result.total)


def test_surgeon_activation_bits_quantizes_what_it_keeps_dense() -> None:
    model, x = MODELS["shipped"]()
    dense, dense_stats = _step_grads("surgeon", model, x, mode="robot")
    g, stats = _step_grads("surgeon", model, x, mode="robot", activation_bits=8)
    assert cosine(dense, g) >= 0.999
    assert stats["saved_bytes"] < 0.5 * dense_stats["saved_bytes"]


@pytest.mark.parametrize("frac", (0.25, 0.5, 0.9))
def test_budget_plan_stays_within_its_memory_budget(frac: float) -> None:
    """Greedy widths between 'all convs dropped' and 'all at 8 bits': the measured saved
    bytes of the forward (units given 0 bits frozen) never exceed the budget."""
    model, x = MODELS["resnet18"]()
    units, _ = trainable_units(model)
    profile = profile_saves(model, x, entropy)
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
        entropy(model(x)).backward()
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


@pytest.mark.parametrize("graph", ("full", "lazy"))
def test_adashadow_activation_bits_records_its_graph_quantized(graph: str) -> None:
    """AdaShadow with activation_bits: the recorded graph (full: the forward from the graph
    floor; lazy: the re-run tail) is saved under the DAF codec; an external plan updating
    every candidate gets the dense gradient back (cosine >= 0.999 / 0.99 at 8 / 4 bits)
    from fewer saved bytes, and the bytes are in the step's stats."""
    model, x = MODELS["shipped"]()

    def grads(**cfg) -> tuple[torch.Tensor, dict]:
        meth = build_method("adashadow", copy.deepcopy(model), lr=0.0, lr_ref_batch=0,
                            input_shape=tuple(x.shape[1:]), bn_mode="batch", graph=graph,
                            **cfg)
        eng = meth.engine
        update = eng.candidates.copy()
        plan = Plan(update=update, first_updated=int(np.flatnonzero(update)[0]),
                    objective=0.0, predicted_total_ms=0.0, budget_ms=0.0, full_ms=0.0,
                    solve_ms=0.0)
        res = eng.step(x, plan)
        assert res.adapted
        return torch.cat([p.grad.double().flatten() for p in eng.params
                          if p.grad is not None]), res.stats

    dense, dense_stats = grads()
    assert "saved_bytes" not in dense_stats
    g8, s8 = grads(activation_bits=8)
    g4, s4 = grads(activation_bits=4)
    assert cosine(dense, g8) >= 0.999 and cosine(dense, g4) >= 0.99
    counter = SavedActivationCounter(model)
    with counter, torch.enable_grad():
        model(x)
    assert 0 < s4["saved_bytes"] < s8["saved_bytes"] < 0.4 * counter.result.total
    assert s4["activation_bits"] == 4


def test_adashadow_activation_bits_and_a_memory_budget_exclude_each_other() -> None:
    model, x = MODELS["shipped"]()
    with pytest.raises(ValueError, match="activation_bits=4 and a memory budget"):
        build_method("adashadow", model, input_shape=tuple(x.shape[1:]), activation_bits=4,
                     memory_budget_mb=1.0)
    with pytest.raises(ValueError, match="bit width for unit '<activation_bits>'"):
        build_method("adashadow", model, input_shape=tuple(x.shape[1:]), activation_bits=3)


def test_tent_activation_budget_keeps_saves_in_the_paged_arena() -> None:
    """activation_budget_mb: the quantized saves live in DAF's paged arena, which never
    holds more than its budget; a budget under the 8-bit bytes downgrades the least worth
    per byte (importance = last step's gradient RMS per unit) and the gradient stays close
    to dense; a budget too small for 2 bits overflows (reported), never crashes."""
    model, x = MODELS["shipped"]()
    dense, _ = _step_grads("tent", model, x)
    _, full = _step_grads("tent", model, x, activation_bits=8)
    budget_mb = 0.6 * full["saved_bytes"] / 2**20
    meth = build_method("tent", copy.deepcopy(model), lr=0.0, lr_ref_batch=0, reforward=False,
                        activation_bits=8, activation_budget_mb=budget_mb)
    for _ in range(2):
        meth.optimizer.zero_grad(set_to_none=True)
        res = meth.forward_and_adapt(x)
        assert res.stats["arena_bytes"] <= res.stats["arena_budget_bytes"]
        assert res.stats["within_arena_budget"] and res.stats["arena_overflow_bytes"] == 0
    assert res.stats["arena_min_bits"] < 8  # something was downgraded
    imp = meth.codec.codec.importance
    assert imp and all(v > 0 for v in imp.values())
    assert set(imp) <= {n for n, m in meth.model.named_modules()
                        if isinstance(m, nn.BatchNorm2d)}
    g = torch.cat([p.grad.double().flatten() for p in meth.params])
    assert cosine(dense, g) >= 0.98
    tiny = build_method("tent", copy.deepcopy(model), activation_bits=8,
                        activation_budget_mb=0.01)
    stats = tiny.step(x).stats
    assert stats["arena_overflow_bytes"] > 0 and not stats["within_arena_budget"]


@pytest.mark.parametrize(("cfg", "match"), (
    ({"activation_budget_mb": -1.0}, "activation_budget_mb must be"),
    ({"activation_bits": 4, "activation_budget_mb": -1.0}, "activation_budget_mb must be"),
))
def test_activation_budget_is_checked(cfg: dict, match: str) -> None:
    model, _ = MODELS["shipped"]()
    with pytest.raises(ValueError, match=match):
        build_method("tent", model, **cfg)


# ---------------------------------------------------------------- dynamic widths
class _TentAll(Tent):
    """Tent's loop with every parameter trainable (what the dynamic widths must serve)."""

    def configure_model(self) -> None:
        super().configure_model()
        self.model.requires_grad_(True)


def _dense_saved(model: nn.Module, x: torch.Tensor) -> int:
    counter = SavedActivationCounter(model)
    with torch.enable_grad(), counter:
        entropy(model(x))
    return counter.result.total


def _all_grads(meth: Tent) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).double().flatten()
                      for p in meth.params])


@pytest.mark.slow
def test_dynamic_widths_hold_the_budget_and_follow_a_runtime_change() -> None:
    """activation_budget_mb alone: per batch, 0/2/4/8 bits per unit (greedy) whose measured
    saved bytes never exceed the budget; 0-bit units are frozen for that batch only; a
    budget changed on the config holds from the next batch; at 30 % of the dense bytes the
    gradient keeps cosine >= 0.99 to the dense one."""
    model, x = MODELS["resnet18"]()
    dense_bytes = _dense_saved(copy.deepcopy(model), x)
    cfg = {"lr": 0.0, "lr_ref_batch": 0, "reforward": False}
    dense = _TentAll(copy.deepcopy(model), TentConfig(**cfg))
    dense.forward_and_adapt(x)
    g_dense = _all_grads(dense)
    meth = _TentAll(copy.deepcopy(model),
                    TentConfig(**cfg, activation_budget_mb=0.10 * dense_bytes / 2**20))
    for _ in range(2):
        meth.optimizer.zero_grad(set_to_none=True)
        s = meth.forward_and_adapt(x).stats
        assert 0 < s["saved_bytes"] <= s["width_budget_bytes"] and s["within_width_budget"]
        zero = [u for u, b in meth.codec.state.bits.items() if b == 0]
        assert s["width_frozen_units"] == len(zero) > 0
        mods = dict(meth.model.named_modules())
        assert all(p.grad is None and p.requires_grad for u in zero
                   for p in mods[u].parameters())
    low_bits = s["width_mean_bits"]
    meth.config.activation_budget_mb = 0.30 * dense_bytes / 2**20
    meth.optimizer.zero_grad(set_to_none=True)
    s = meth.forward_and_adapt(x).stats
    assert s["width_budget_bytes"] == int(0.30 * dense_bytes)
    assert s["saved_bytes"] <= s["width_budget_bytes"] and s["width_mean_bits"] > low_bits
    meth.optimizer.zero_grad(set_to_none=True)
    meth.forward_and_adapt(x)
    assert cosine(g_dense, _all_grads(meth)) >= 0.99
    meth.config.activation_budget_mb = None
    with pytest.raises(ValueError, match=r"activation_budget_mb must be .* got None"):
        meth.forward_and_adapt(x)


def test_dynamic_widths_for_tent_choose_only_norm_widths() -> None:
    """Tent (BN affine): frozen convs store nothing, each BN input gets 2/4/8 bits; the
    step holds its budget and its BN gradient stays close to dense Tent's."""
    model, x = MODELS["shipped"]()
    dense, _ = _step_grads("tent", model, x)
    _, full = _step_grads("tent", model, x, activation_bits=8)
    meth = build_method("tent", copy.deepcopy(model), lr=0.0, lr_ref_batch=0,
                        reforward=False, activation_budget_mb=0.7 * full["saved_bytes"] / 2**20)
    for _ in range(2):
        meth.optimizer.zero_grad(set_to_none=True)
        s = meth.forward_and_adapt(x).stats
        assert s["saved_bytes"] <= s["width_budget_bytes"] and s["within_width_budget"]
    bits = meth.codec.state.bits
    bns = {n for n, m in meth.model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    assert set(bits) == bns and set(bits.values()) <= {2, 4, 8}
    assert s["width_frozen_units"] == 0
    g = torch.cat([p.grad.double().flatten() for p in meth.params])
    assert cosine(dense, g) >= 0.98

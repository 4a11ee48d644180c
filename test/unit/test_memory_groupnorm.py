"""GroupNorm units in the saved-activation machinery (memory.scope, memory.codec, DAF's
statistic counts): a GN unit's input is recognised as a norm input, DAF's norm widths
quantize it, centred pruning keeps its means, and the gradients stay close to dense."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tta_core.daf.dynamic import stat_counts
from tta_core.memory import ActivationCodec, CodecPlan, SavedActivationCounter
from tta_core.memory.predict import profile_saves
from tta_core.memory.scope import OTHER, UnitScope

pytestmark = pytest.mark.usefixtures("one_thread")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.GroupNorm(4, 16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1, bias=False), nn.GroupNorm(8, 32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _batch() -> torch.Tensor:
    return torch.randn((4, 3, 16, 16), generator=torch.Generator().manual_seed(1))


def _gn_units(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.GroupNorm)]


def _grads(model: nn.Module, x: torch.Tensor, ctx) -> tuple[torch.Tensor, object]:
    params = [p for p in model.parameters() if p.requires_grad]
    with ctx:
        logp = model(x).log_softmax(1)
        loss = -(logp.exp() * logp).sum(1).mean()
    grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1) for g in grads]), ctx.result


def test_scope_marks_groupnorm_inputs() -> None:
    model = _net()
    scope = UnitScope(model)
    kinds = {name: kind for name, _m, kind in scope.units}
    assert [kinds[u] for u in _gn_units(model)] == ["gn", "gn"]
    sites = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not scope.is_state(t):
            sites.append((scope.classify(t), tuple(t.shape)))
        return t

    scope.install()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(_batch())
    finally:
        scope.remove()
    gn_inputs = [(s.unit, shape) for s, shape in sites if s.input_of == "gn"]
    assert gn_inputs == [("1", (4, 16, 16, 16)), ("4", (4, 32, 8, 8))]


def test_daf_norm_widths_quantize_groupnorm_inputs() -> None:
    """norm_bits=8: the GN units hold about a quarter of their dense bytes, gradient cos ~1;
    at 2 bits the gradient moves further from dense than at 8."""
    model = _net()
    x = _batch()
    dense, base = _grads(model, x, SavedActivationCounter(model))
    gn = _gn_units(model)
    cos, held = {}, {}
    for bits in (8, 2):
        g, res = _grads(model, x, ActivationCodec(model, CodecPlan(norm_bits=bits)))
        cos[bits] = float(torch.nn.functional.cosine_similarity(dense, g, dim=0))
        held[bits] = sum(res.per_unit[u] for u in gn)
    dense_gn = sum(base.per_unit[u] for u in gn)
    assert held[8] < 0.4 * dense_gn and held[2] < held[8], (held, dense_gn)
    assert cos[8] > 0.999 and cos[2] < cos[8], cos


def test_centred_pruning_of_groupnorm_inputs() -> None:
    model = _net()
    x = _batch()
    dense, base = _grads(model, x, SavedActivationCounter(model))
    plan = CodecPlan(norm_keep=dict.fromkeys(_gn_units(model), 0.3))
    pruned, res = _grads(model, x, ActivationCodec(model, plan))
    cos = float(torch.nn.functional.cosine_similarity(dense, pruned, dim=0))
    assert res.by_role[OTHER] < 0.6 * base.by_role[OTHER]
    assert 0.9 < cos < 1.0 - 1e-6, cos


def test_stat_counts_per_group() -> None:
    """Values behind one GN statistic: (C / G) * H * W of its input."""
    model = _net()
    profile = profile_saves(model, _batch())
    counts = stat_counts(profile, model, _gn_units(model))
    assert counts == {"1": 16 / 4 * 16 * 16, "4": 32 / 8 * 8 * 8}

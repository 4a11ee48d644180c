"""The generic family: stages cut from a torchvision model's fx graph chain to its forward,
restart from any stage's cached input, and AdaShadow adapts every family on them.

Default run: mobilenet_v3_small, shufflenet_v2_x0_5 and a small ConvNeXt (torchvision's
class, one block per stage); the other families are marked slow."""

from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
from helpers.models import assert_replay_skips_units
from torch import nn
from torchvision import models as tvm
from torchvision.models.convnext import CNBlockConfig, ConvNeXt

from tta_core.adashadow.planning import UnitLayout
from tta_core.model.units import decompose, stage_input_hooks
from tta_core.registry import build_method

SIZE = 64
QUICK = ("mobilenet_v3_small", "shufflenet_v2_x0_5", "convnext_small_blocks")
SLOW = ("efficientnet_b0", "regnet_y_400mf", "convnext_tiny", "mobilenet_v2", "resnet18")


def convnext_small_blocks() -> ConvNeXt:
    """torchvision's ConvNeXt with one block per stage and narrow widths (LayerNorm,
    layer_scale, depthwise convs: the same parts as convnext_tiny)."""
    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, 64, 1),
                     CNBlockConfig(64, None, 1)], num_classes=10)


@functools.cache
def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return (convnext_small_blocks() if family == "convnext_small_blocks"
            else getattr(tvm, family)(weights=None, num_classes=10))


def make(family: str) -> nn.Module:
    """A fresh copy of the family's model (the same random weights on every call)."""
    return copy.deepcopy(_model(family))


def _params(families: tuple[str, ...], slow: tuple[str, ...]) -> list:
    return [*families, *(pytest.param(f, marks=pytest.mark.slow) for f in slow)]


@pytest.mark.parametrize("family", _params(QUICK, SLOW[:4]))
def test_stages_chain_to_the_forward_and_restart_from_any_cached_input(
        family: str, one_thread) -> None:
    model = make(family).eval()
    staged = decompose(model, (3, SIZE, SIZE))
    generic = family not in ("mobilenet_v2", "resnet18")
    assert (staged.arch == "generic") == generic
    assert len(staged.stages) >= 5, [st.name for st in staged.stages]
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(1))
    seen: dict[int, list[torch.Tensor]] = {}
    handles = stage_input_hooks(staged, lambda s, t: seen.setdefault(s, []).append(t))
    with torch.no_grad():
        full = model(x)
    for h in handles:
        h.remove()
    assert sorted(seen) == list(range(1, len(staged.stages)))
    assert all(len(v) == 1 for v in seen.values())  # each stage input shown once
    with torch.no_grad():
        h = x
        for st in staged.stages:  # the stages chained: exactly the forward
            if st.index:
                torch.testing.assert_close(seen[st.index][0], h, rtol=0.0, atol=0.0)
            h = st.module(h)
        torch.testing.assert_close(h, full, rtol=0.0, atol=0.0)
        for s in range(len(staged.stages)):
            got = staged.forward_from(s, x if s == 0 else seen[s][0])
            torch.testing.assert_close(got, full, rtol=0.0, atol=0.0)
    # units in forward order, each stage's contiguous, every parameter in one unit
    assert [u.stage for u in staged.units] == sorted(u.stage for u in staged.units)
    owned = [id(p) for u in staged.units for p in u.parameters()]
    assert sorted(owned) == sorted(id(p) for p in model.parameters())


def test_a_restart_inside_a_stage_replays_the_units_before_it(one_thread) -> None:
    """forward_from(stage, input, outputs of the replayable units before d) equals the
    forward and does not run those units (the GraphModule pieces call the model's layers
    through their own containers, which the replay swaps)."""
    staged = decompose(make("mobilenet_v3_small").eval(), (3, SIZE, SIZE))
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    outs: dict[int, torch.Tensor] = {}
    ins: dict[int, torch.Tensor] = {0: x}
    hooks = [u.module.register_forward_hook(lambda _m, _a, o, i=u.index: outs.__setitem__(i, o))
             for u in staged.units]
    hooks += stage_input_hooks(staged, ins.__setitem__)
    with torch.no_grad():
        full = staged.model(x)
    for h in hooks:
        h.remove()
    restart, start = staged.restart_start(), staged.stage_start()
    inside = [d for d in range(len(staged.units)) if restart[d] > start[d]]
    assert inside
    for d in inside[:8]:
        unit = staged.units[d]
        replay = {u: outs[u] for u in range(start[d], d) if staged.units[u].replayable}
        assert replay
        assert_replay_skips_units(staged, unit.stage, ins[unit.stage], replay, full)


def test_convnext_units_layer_scale_and_layer_norms() -> None:
    model = make("convnext_small_blocks")
    staged = decompose(model, (3, SIZE, SIZE))
    scale = [u for u in staged.units if u.kind == "scale"]
    blocks = [m for m in model.modules() if hasattr(m, "layer_scale")]
    assert [u.module for u in scale] == blocks and len(blocks) == 3
    for u in scale:  # owns its layer_scale only, costed as one multiply per output value
        assert u.parameters() == [u.module.layer_scale]
        assert u.params == u.module.layer_scale.numel()
        assert u.macs_fwd == u.macs_dw > 0 and not u.replayable
    names = [u.name for u in staged.units]
    # the multiply follows the block's last linear layer, before the next block
    assert names.index("features.1.0") == names.index("features.1.0.block.5") + 1
    assert {u.kind for u in staged.units} == {"conv", "ln", "linear", "scale"}


def test_group_norm_is_a_norm_unit() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    staged = decompose(model, (3, 8, 8))
    gn = staged.units[1]
    assert gn.kind == "gn" and gn.macs_fwd == 2 * 8 * 6 * 6
    assert [st.name for st in staged.stages] == ["0", "1", "2", "3", "4", "5"]  # per layer
    # AdaShadow's trainable "norm" takes it
    assert UnitLayout.from_staged(staged).trainable("norm").tolist() == [False, True, False]


class _Branchy(nn.Module):
    """Python control flow on a tensor value: torch.fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if y.mean() > 0:
            y = -y
        return self.fc(y.mean((2, 3)))


def test_an_untraceable_model_is_one_stage_and_says_so(caplog) -> None:
    model = _Branchy().eval()
    with caplog.at_level(logging.DEBUG, logger="tta_core.model.fx_stages"):
        staged = decompose(model, (3, 8, 8))
    assert "torch.fx cannot trace _Branchy" in caplog.text
    assert [st.name for st in staged.stages] == ["model"]
    assert [u.stage for u in staged.units] == [0, 0]
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(staged.forward_from(0, x), model(x))


@pytest.mark.parametrize("family", _params(QUICK, SLOW[:3]))
def test_adashadow_updates_units_on_every_family(family: str, one_thread) -> None:
    """sigma=1.0: the budget of one more forward; a later batch differs from the first
    (no source statistics without BN: the first batch's importance is zero)."""
    m = build_method("adashadow", make(family), input_shape=(3, SIZE, SIZE), sigma=1.0)
    assert m.config.bn_mode == "robust"  # the default: on ConvNeXt, no BN layer to move
    gen = torch.Generator().manual_seed(3)
    updated = [m.step(torch.randn(4, 3, SIZE, SIZE, generator=gen)).units_updated
               for _ in range(3)]
    m.close()
    assert max(updated) >= 1, updated
    kinds = {u.kind for u, ok in zip(m.engine.staged.units, m.engine.candidates, strict=True)
             if ok}
    # trainable "norm": the BN units, or the LayerNorm affine where there is no BN
    assert kinds == ({"ln"} if family.startswith("convnext") else {"bn"})

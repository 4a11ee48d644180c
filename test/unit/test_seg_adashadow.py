"""AdaShadow on a segmentation net: a small random-weight LR-ASPP MobileNetV3 at 64 x 128.

Its fx stages cross several values (the input, whose shape the last upsampling reads, and
the low-level feature the head joins): the stages chain to the forward and restart from
any cached input; AdaShadow updates units on its adapting batches and answers N x C x H x W
logits (predictions N x H x W); seg_bench no longer refuses it."""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from tta_core.api import Plan
from tta_core.eval.seg_bench import SEG_METHODS, check_methods
from tta_core.model.units import decompose, stage_input_hooks
from tta_core.model.zoo import build_model
from tta_core.registry import build_method

HW = (64, 128)
CLASSES = 5


@functools.cache
def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("lraspp_mobilenet_v3_large", CLASSES).eval()


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 3, *HW, generator=g) for _ in range(n)]


def test_lraspp_stages_cross_several_values_and_chain_to_the_forward(one_thread) -> None:
    model = copy.deepcopy(_net())
    staged = decompose(model, (3, *HW))
    assert len(staged.stages) >= 10, [st.name for st in staged.stages]
    x = _batches(1)[0]
    seen: dict[int, list] = {}
    handles = stage_input_hooks(staged, lambda s, t: seen.setdefault(s, []).append(t))
    with torch.no_grad():
        full = model(x)
    for h in handles:
        h.remove()
    assert sorted(seen) == list(range(1, len(staged.stages)))
    assert all(len(v) == 1 for v in seen.values())
    # the head's input: the model input, the low-level feature and the trunk's output
    head = seen[len(staged.stages) - 1][0]
    assert isinstance(head, tuple) and len(head) == 3 and head[0] is x
    assert any(isinstance(v[0], tuple) for v in seen.values())
    with torch.no_grad():
        for s in range(len(staged.stages)):
            got = staged.forward_from(s, x if s == 0 else seen[s][0])
            torch.testing.assert_close(got, full, rtol=0.0, atol=0.0)
    # the head's units are its own stage: a head update reforwards the head only
    last = staged.stages[-1]
    assert {u.name.split(".")[1] for u in staged.units[last.first_unit:]} == {"classifier"}


def test_adashadow_updates_units_and_answers_per_pixel(one_thread) -> None:
    model = copy.deepcopy(_net())
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    meth = build_method("adashadow", model, input_shape=(3, *HW), sigma=1.0,
                        memory_format="contiguous")
    results = []
    for x in _batches(4):
        res = meth.step(x)
        meth.finish()
        results.append(res)
        assert res.logits.shape == (2, CLASSES, *HW)
        assert res.logits.argmax(1).shape == (2, *HW)  # predictions N x H x W
        assert bool(torch.isfinite(res.logits).all())
    adapted = [r for r in results if r.adapted]
    assert adapted, [r.planning.no_room for r in results]
    names = meth.unit_names
    for r in adapted:
        assert r.units_updated >= 1
        assert r.units_updated == int(np.count_nonzero(r.plan.update))
    updated = {names[i] for r in adapted for i in np.flatnonzero(r.plan.update)}
    moved = {k.rpartition(".")[0] for k, v in model.named_parameters()
             if not torch.equal(v, before[k])}
    assert updated <= moved  # every unit a plan updated changed its parameters


def test_seg_bench_takes_adashadow() -> None:
    assert "adashadow" in SEG_METHODS
    check_methods(("source", "adashadow"))


@pytest.mark.parametrize("loss", ["multilayer_kl"])
def test_adashadow_paper_loss_steps_on_the_segmentation_net(loss, one_thread) -> None:
    """§4's multi-layer KL on the per-channel statistics: it plans and steps on N x C x H x W."""
    model = copy.deepcopy(_net())
    meth = build_method("adashadow", model, input_shape=(3, *HW), sigma=1.0, loss=loss,
                        memory_format="contiguous")
    results = []
    for x in _batches(3):
        results.append(meth.step(x))
        meth.finish()
    assert all(r.logits.shape == (2, CLASSES, *HW) for r in results)
    assert any(r.adapted and r.units_updated >= 1 for r in results)


class _TwoBN(torch.nn.Module):
    """A user's small segmentation net: two conv-BN-ReLU, a conv head, upsampling."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8),
            torch.nn.ReLU())
        self.head = torch.nn.Conv2d(8, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.interpolate(self.head(self.body(x)), size=x.shape[-2:],
                                               mode="bilinear", align_corners=False)


def test_a_net_with_fewer_bn_layers_than_bn_batch_layers_keeps_its_last_robust(
        one_thread) -> None:
    """Robust BN puts the first bn_batch_layers (3) BN layers on batch statistics, but never
    the last one: a 2-BN net keeps body.4 robust, as AdaShadow's one candidate, and an update
    of it moves its affine only."""
    torch.manual_seed(0)
    model = _TwoBN().eval()
    meth = build_method("adashadow", model, input_shape=(3, 32, 32), lr=0.05,
                        lr_ref_batch=0)
    eng = meth.engine
    names = [u.name for u in eng.staged.units]
    assert [names[i] for i in np.flatnonzero(eng.candidates)] == ["body.4"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    update = eng.candidates.copy()
    plan = Plan(update=update, first_updated=int(np.flatnonzero(update)[0]), objective=0.0,
                predicted_total_ms=0.0, budget_ms=0.0, full_ms=0.0, solve_ms=0.0)
    res = eng.step(_batches(1)[0][:, :, :32, :32], plan)
    assert res.adapted and res.logits.shape == (2, CLASSES, 32, 32)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == {"body.4.weight", "body.4.bias"}

"""TTA methods behind one interface: what each may change, reset, registry errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from tta_core.adashadow.planning import UnitLayout, mac_profile
from tta_core.model.zoo import build_model
from tta_core.registry import available_methods, build_method

CFG = {"input_shape": (3, 32, 32)}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("small_resnet", 10)


def _batches(n: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 3, 32, 32, generator=g) * (1 + 0.5 * i) for i in range(n)]


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _changed(model: nn.Module, snap: dict[str, torch.Tensor]) -> set[str]:
    return {k for k, v in model.named_parameters() if not torch.equal(v, snap[k])}


def test_registry_lists_required_methods() -> None:
    assert {"source", "bn_adapt", "tent", "adashadow"} <= set(available_methods())


def test_unknown_method_lists_available_names() -> None:
    with pytest.raises(ValueError, match=r"nope.*adashadow.*bn_adapt.*source.*tent"):
        build_method("nope", _model())


def test_unknown_option_rejected() -> None:
    with pytest.raises(ValueError, match="sigmaa"):
        build_method("adashadow", _model(), sigmaa=0.3, **CFG)


@pytest.mark.parametrize("name", ["source", "bn_adapt"])
def test_source_and_bn_adapt_change_no_parameter(name: str) -> None:
    model = _model()
    snap = _snapshot(model)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    m = build_method(name, model, **CFG)
    for x in _batches():
        res = m.step(x)
        assert res.logits.shape == (4, 10) and not res.adapted
    assert _changed(model, snap) == set()
    if name == "source":  # eval mode: running statistics untouched
        assert all(torch.equal(v, buffers[k]) for k, v in model.named_buffers())


def test_bn_adapt_uses_batch_statistics() -> None:
    x = _batches(1)[0] * 5 + 3
    src = build_method("source", _model(), **CFG).step(x).logits
    bn = build_method("bn_adapt", _model(), **CFG).step(x).logits
    assert not torch.allclose(src, bn, atol=1e-3)


def test_tent_changes_only_bn_affine() -> None:
    model = _model()
    snap = _snapshot(model)
    m = build_method("tent", model, lr=0.05, **CFG)
    for x in _batches():
        assert m.step(x).adapted
    bn_names = {f"{n}.{p}" for n, mod in model.named_modules()
                if isinstance(mod, nn.BatchNorm2d) for p in ("weight", "bias")}
    changed = _changed(model, snap)
    assert changed and changed <= bn_names
    assert len(changed) >= len(bn_names) // 2


def test_tent_predicts_pre_update_by_default_and_updated_with_reforward() -> None:
    """Default (the paper): the prediction is the forward before the update, i.e. the
    source weights on batch statistics (bn_adapt's); reforward=True: the updated model's."""
    x = _batches(1)[0]
    before = build_method("bn_adapt", _model(), **CFG).step(x).logits
    plain = build_method("tent", _model(), lr=0.5, **CFG).step(x).logits
    torch.testing.assert_close(plain, before, rtol=1e-5, atol=1e-6)
    model = _model()
    res = build_method("tent", model, lr=0.5, reforward=True, **CFG).step(x)
    with torch.no_grad():
        assert torch.allclose(res.logits, model(x), atol=1e-6)
    assert not torch.allclose(res.logits, plain, atol=1e-4)


@pytest.mark.parametrize("name,cfg", [
    # fixed_cost_feedback 0: the same plans before and after the reset (the learnt fixed
    # costs are a property of the machine and survive it, so plans could differ)
    ("tent", {}), ("adashadow", {"sigma": 1.0, "fixed_cost_feedback": 0.0}),
    ("adashadow", {"sigma": 1.0, "loss": "multilayer_kl", "fixed_cost_feedback": 0.0}),
    ("adashadow", {"sigma": 1.0, "mode": "parallel", "fixed_cost_feedback": 0.0}),
])
def test_reset_restores_bit_for_bit(name: str, cfg: dict) -> None:
    model = _model()
    m = build_method(name, model, lr=0.05, **cfg, **CFG)
    xs = _batches(3)
    first = [m.step(x).logits for x in xs]
    m.finish()  # parallel mode: the last batch's update must have landed before the snapshot
    snap_after = _snapshot(model)
    m.reset()
    assert _changed(model, _snapshot(_model())) == set()
    again = [m.step(x).logits for x in xs]
    m.finish()
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)  # same weights, optimizer and assessor state
    assert _changed(model, snap_after) == set()


def test_adashadow_sigma_monotone_in_units_updated() -> None:
    """Fixed MAC-proportional unit times (fixed costs off): the plan depends only on the
    importance and sigma, and the budget sigma * T grows with sigma. T (a full update) is
    about 4x the forward T_f, so at sigma 0.2 not even the forward fits and no unit is
    updated; at 1.0 the budget is a full update, so every trainable unit fits; 0.5 lies
    strictly between."""
    res = {}
    for sigma in (0.2, 0.5, 1.0):
        m = build_method("adashadow", _model(), sigma=sigma, fixed_cost_feedback=0.0, **CFG)
        # fixed unit times: the plan then depends only on importance and sigma
        m.engine.profile = mac_profile(UnitLayout.from_staged(m.staged), 10.0, 4)
        res[sigma] = [m.step(x) for x in _batches(4)]
        n_trainable = int(m.engine.candidates.sum())
    for sigma, rs in res.items():
        for r in rs:  # times scale with each batch's measured forward: compare shares of T
            assert r.budget_ms / r.plan.full_ms == pytest.approx(sigma)
            assert r.units_updated == int(r.plan.update.sum())
            if r.units_updated:
                assert r.plan.predicted_total_ms <= r.budget_ms  # the plan keeps the budget
    assert all(r.units_updated == 0 and r.plan.predicted_total_ms > r.budget_ms
               for r in res[0.2])  # the empty plan (the forward alone) is over budget
    assert all(0 < r.units_updated < n_trainable for r in res[0.5])
    assert all(r.units_updated == n_trainable for r in res[1.0])
    for lo, hi in zip(res[0.5], res[1.0], strict=True):  # per batch, strictly more work
        assert hi.units_updated > lo.units_updated
        assert (hi.plan.predicted_total_ms / hi.plan.full_ms
                > lo.plan.predicted_total_ms / lo.plan.full_ms)
    totals = {s: sum(r.units_updated for r in rs) for s, rs in res.items()}
    assert totals[1.0] > totals[0.5] > totals[0.2] == 0


def test_adashadow_updates_only_planned_units() -> None:
    """Every parameter of every planned unit changes on its batch, no other one does.
    Fixed costs off: the plan then does not depend on the measured step times, and at
    sigma 0.5 every batch updates some but not all trainable units."""
    model = _model()
    m = build_method("adashadow", model, sigma=0.5, lr=0.05, fixed_cost_feedback=0.0, **CFG)
    owner = {id(p): u.index for u in m.staged.units for p in u.parameters()}
    assert len(owner) == len(list(model.parameters()))  # every parameter has its unit
    n_trainable = int(m.engine.candidates.sum())
    for x in _batches(3):
        snap = _snapshot(model)
        res = m.step(x)
        planned = set(np.flatnonzero(res.plan.update).tolist())
        assert res.adapted and 0 < len(planned) < n_trainable
        assert res.units_updated == len(planned)
        assert all(m.engine.candidates[u] for u in planned)
        changed = {k for k, p in model.named_parameters() if not torch.equal(p, snap[k])}
        in_plan = {k for k, p in model.named_parameters() if owner[id(p)] in planned}
        assert changed == in_plan  # each planned unit's parameters moved, nothing else did
        assert {owner[id(p)] for k, p in model.named_parameters() if k in changed} == planned


@pytest.mark.parametrize("name", ["tent", "adashadow"])
def test_learning_rate_scales_linearly_with_batch_and_survives_reset(name: str) -> None:
    m = build_method(name, _model(), lr=8e-3, lr_ref_batch=64, input_shape=(3, 32, 32))
    def lrs() -> list[float]:
        return sorted({g["lr"] for g in m.optimizer.param_groups})

    m.step(torch.randn(4, 3, 32, 32))
    assert lrs() == pytest.approx([8e-3 * 4 / 64])
    m.step(torch.randn(16, 3, 32, 32))
    assert lrs() == pytest.approx([8e-3 * 16 / 64])
    m.set_lr(1e-3)
    m.step(torch.randn(16, 3, 32, 32))
    assert lrs() == pytest.approx([1e-3 * 16 / 64])
    m.reset()
    m.step(torch.randn(16, 3, 32, 32))
    assert lrs() == pytest.approx([1e-3 * 16 / 64])
    unscaled = build_method(name, _model(), lr=8e-3, lr_ref_batch=0, input_shape=(3, 32, 32))
    unscaled.step(torch.randn(4, 3, 32, 32))
    assert {g["lr"] for g in unscaled.optimizer.param_groups} == {8e-3}


def test_pending_parallel_update_keeps_the_learning_rate_it_was_started_with(
        monkeypatch) -> None:
    """Parallel mode, batch 4 then batch 8: the background update of the first batch steps
    with batch 4's scaled lr, although the next step (batch 8) rescales the lr; the
    rescaling waits for the update in flight."""
    import threading

    model = build_model("small_resnet", 10)
    meth = build_method("adashadow", model, input_shape=(3, 32, 32), mode="parallel",
                        sigma=1.0, fixed_cost_feedback=0.0, lr=0.64, lr_ref_batch=64)
    import tta_core.adashadow.engine as engine_mod

    release, seen = threading.Event(), []
    step = engine_mod._sgd_step  # the engine's optimizer step of the selected units

    def slow_step(opt, *a):  # the second update waits until the test releases it
        if len(seen) == 1:
            release.wait(5.0)
        seen.append(opt.param_groups[0]["lr"])
        return step(opt, *a)

    monkeypatch.setattr(engine_mod, "_sgd_step", slow_step)
    torch.manual_seed(0)
    meth.step(torch.randn(4, 3, 32, 32))
    meth.step(torch.randn(4, 3, 32, 32))
    threading.Timer(0.3, release.set).start()
    meth.step(torch.randn(8, 3, 32, 32))
    meth.finish()
    lr4, lr8 = 0.64 * 4 / 64, 0.64 * 8 / 64
    assert len(seen) == 3, seen  # every batch adapted (sigma 1)
    assert seen == [pytest.approx(lr4), pytest.approx(lr4), pytest.approx(lr8)]
    meth.close()

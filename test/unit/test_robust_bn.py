"""AdaShadow's bn_mode "robust" (tta_core.adashadow.engine.robust_bn): the bottom BN layers
normalise with batch statistics and keep the source affine; the others with running
statistics that each batch's own forward -- never a reforward or the lazy re-run of the
tail -- moves toward its batch statistics by RoTTA's rule."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tta_core.model.zoo import build_model
from tta_core.registry import build_method

CFG = {"input_shape": (3, 32, 32), "sigma": 1.0, "fixed_cost_feedback": 0.0}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = build_model("small_resnet", 10)
    for m in model.modules():  # source statistics that differ from the test batches'
        if isinstance(m, _BatchNorm):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    return model


def _bns(model: nn.Module) -> list[_BatchNorm]:
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


@pytest.mark.parametrize("graph", ["full", "lazy"])
def test_each_batch_moves_the_running_statistics_once(graph: str) -> None:
    model = _model()
    meth = build_method("adashadow", model, bn_mode="robust", bn_momentum=0.1,
                        bn_momentum_batch=4, bn_batch_layers=3, graph=graph, **CFG)
    bns = _bns(model)
    assert all(bn.training for bn in bns[:3])  # batch statistics
    assert all(not bn.training and bn.running_mean is not None for bn in bns[3:])
    seen: list[list[torch.Tensor]] = [[] for _ in bns]
    hooks = [bn.register_forward_pre_hook(lambda m, a, k=k: seen[k].append(a[0].detach()))
             for k, bn in enumerate(bns)]
    g = torch.Generator().manual_seed(1)
    try:
        for _ in range(3):
            before = [(bn.running_mean.clone(), bn.running_var.clone()) for bn in bns[3:]]
            for s in seen:
                s.clear()
            res = meth.step(torch.randn(4, 3, 32, 32, generator=g) * 2 + 0.5)
            assert res.adapted  # sigma 1: backward and reforward (or re-run tail) ran
            assert any(len(s) > 1 for s in seen)  # some layer saw a second pass
            for bn, (mu, var), inputs in zip(bns[3:], before, seen[3:], strict=True):
                v, m = torch.var_mean(inputs[0], dim=(0, 2, 3), correction=1)
                torch.testing.assert_close(bn.running_mean, 0.9 * mu + 0.1 * m)
                torch.testing.assert_close(bn.running_var, 0.9 * var + 0.1 * v)
    finally:
        for h in hooks:
            h.remove()
        meth.close()


def test_batch_statistics_layers_are_not_candidates_and_reset_restores_the_source() -> None:
    model = _model()
    source = [bn.running_mean.clone() for bn in _bns(model)]
    meth = build_method("adashadow", model, bn_batch_layers=2, **CFG)  # robust: the default
    units = meth.staged.units
    bn_units = [u.index for u in units if isinstance(u.module, _BatchNorm)]
    assert not meth.trainable[bn_units[:2]].any() and meth.trainable[bn_units[2:]].all()
    meth.step(torch.randn(4, 3, 32, 32) * 3)
    assert not torch.equal(_bns(model)[2].running_mean, source[2])
    meth.reset()
    for bn, mu in zip(_bns(model)[2:], source[2:], strict=True):
        assert torch.equal(bn.running_mean, mu)
    meth.close()


def test_batch_mode_stays_available_and_other_methods_refuse_robust() -> None:
    meth = build_method("adashadow", _model(), bn_mode="batch", **CFG)
    assert all(bn.training for bn in _bns(meth.model))  # batch statistics everywhere
    assert np.asarray(meth.trainable).sum() == len(_bns(meth.model))
    meth.close()
    with pytest.raises(ValueError, match="bn_mode 'robust' is not supported by tent"):
        build_method("tent", _model(), bn_mode="robust", input_shape=(3, 32, 32))
    for bad in ({"bn_momentum": 0.0}, {"bn_momentum": 1.5}, {"bn_batch_layers": -1},
                {"bn_batch_layers": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            build_method("adashadow", _model(), **bad, **CFG)


def test_batches_served_without_update_still_move_the_statistics() -> None:
    """A deadline no forward can meet: after the first batch every batch is served
    without plan (a plain forward); robust BN still follows the stream, every other batch
    at the momentum of two once a served forward fills > THIN_ABOVE of the deadline
    (thinning), except on batches that start late (a backlog), which skip the update to
    catch up."""
    model = _model()
    meth = build_method("adashadow", model, deadline_mode="fixed", deadline_ms=1e-3,
                        bn_momentum_batch=4, **CFG)
    bn = _bns(model)[-1]
    m = meth.engine.config.bn_momentum
    g = torch.Generator().manual_seed(2)
    moved = []
    for i in range(6):
        before = (bn.running_mean.clone(), bn.running_var.clone())
        x = torch.randn(4, 3, 32, 32, generator=g) * 2 + 1
        seen: list[torch.Tensor] = []
        h = bn.register_forward_pre_hook(
            lambda _m, a, seen=seen: seen.append(a[0].detach().clone()))
        res = meth.step(x)
        h.remove()
        assert not res.adapted
        moved.append(not torch.equal(bn.running_mean, before[0]))
        if i:
            assert res.planning.skipped and not res.importance.any()  # no plan phase
        if i >= 2 and moved[-1]:  # a thinned update stands for two batches
            mu, var = before[0].clone(), before[1].clone()
            torch.batch_norm_update_stats(seen[0], mu, var, 1 - (1 - m) ** 2)
            assert torch.allclose(bn.running_mean, mu, atol=1e-6)
            assert torch.allclose(bn.running_var, var, atol=1e-6)
    assert moved[:2] == [True, True]  # the first served batch sets the stride
    assert moved[2:] in ([True, False, True, False], [False, True, False, True])
    # a backlog (the batch starts late): catch up first, the statistics stay
    meth.set_lateness(5.0)
    for _ in range(2):
        before = bn.running_mean.clone()
        res = meth.step(torch.randn(4, 3, 32, 32, generator=g) * 2 + 1)
        assert res.planning.skipped and torch.equal(bn.running_mean, before)
    meth.set_lateness(0.0)  # on time again: they move (thinned: within two batches)
    before = bn.running_mean.clone()
    for _ in range(2):
        meth.step(torch.randn(4, 3, 32, 32, generator=g) * 2 + 1)
    assert not torch.equal(bn.running_mean, before)
    meth.close()


def test_forward_times_scale_plain_forwards_and_forget_a_cold_start() -> None:
    """The graph floor's forward estimate (engine.ForwardTimes): a cold first batch
    (5.2 ms for 4 frames) is forgotten once served batches come in; a plain forward
    counts at the planned / plain ratio last measured on adjacent batches."""
    from tta_core.adashadow.engine import ForwardTimes

    ft = ForwardTimes()
    assert math.isnan(ft.estimate_ms(4))
    ft.note(5.2, 4)  # cold, planned
    assert ft.estimate_ms(4) == pytest.approx(5.2)
    ft.note_plain(1.2, 4)  # served: no ratio known yet
    assert ft.estimate_ms(4) == pytest.approx(1.2) and ft.estimate_ms(8) == pytest.approx(2.4)
    ft.note(1.5, 4)  # planned right after a plain one: ratio 1.25
    assert ft.ratio == pytest.approx(1.25)
    ft.note_plain(1.2, 4)
    ft.note_plain(1.2, 4)
    assert ft.estimate_ms(4) == pytest.approx(1.5)  # plain 1.2 counts as a planned 1.5
    ft.note(1.0, 4)  # a planned forward faster than the plain one before it
    assert ft.ratio == 1.0  # never below 1


def test_plan_phases_that_find_no_room_are_held_back_ever_longer() -> None:
    """After n plan phases in a row without an update, 2**(n-1) - 1 batches are served
    without one (at most 63); an update ends the hold."""
    from tta_core.adashadow.engine import ForwardTimes

    ft = ForwardTimes()
    held = []
    for _ in range(9):
        ft.planned(False)
        n = 0
        while ft.holding():
            n += 1
        held.append(n)
    assert held == [0, 1, 3, 7, 15, 31, 63, 63, 63]
    ft.planned(True)
    assert not ft.holding()


def test_robust_layers_hold_no_hooks_copy_independently_and_get_their_class_back() -> None:
    """RobustBN swaps the layers' class (no hook: PyTorch's fast call path); isinstance and
    the state_dict keys are unchanged, a deepcopy moves only its own statistics, and close
    restores the class; a second controller on the same layers takes over (no double
    update)."""
    import copy

    from tta_core.model.robust_bn import RobustBN

    model = _model().eval()
    keys = list(model.state_dict())
    bns = _bns(model)
    rbn = RobustBN(bns[1:], 0.1)
    assert all(isinstance(b, torch.nn.BatchNorm2d) and not b._forward_pre_hooks for b in bns)
    assert list(model.state_dict()) == keys and type(bns[1]) is not torch.nn.BatchNorm2d
    twin = copy.deepcopy(model)
    before = bns[-1].running_mean.clone()
    with torch.no_grad():
        twin(torch.randn(4, 3, 32, 32) + 3)
    assert torch.equal(bns[-1].running_mean, before)  # the copy moved its own
    assert not torch.equal(_bns(twin)[-1].running_mean, before)
    seen = []
    second = RobustBN(bns[1:], 0.1)
    second.update = lambda bn, x: seen.append(bn)  # type: ignore[method-assign]
    with torch.no_grad():
        model(torch.randn(4, 3, 32, 32))
    assert len(seen) == len(bns) - 1 and torch.equal(bns[-1].running_mean, before)
    rbn.close()  # not its layers any more: nothing to undo
    assert type(bns[1]) is not torch.nn.BatchNorm2d
    second.close()
    assert all(type(b) is torch.nn.BatchNorm2d and not hasattr(b, "_tta_robust") for b in bns)


@pytest.mark.parametrize("channels_last", [False, True])
def test_lag_normalises_with_the_statistics_before_the_batch_in_one_read(
        channels_last: bool, monkeypatch) -> None:
    """bn_lag: each robust layer's output is eval-mode BN with its running statistics as
    they were before the batch, which then move by RoTTA's rule, in one call of the fused
    kernel per layer, inside the recorded graph too; there the gradients of the input and
    the affine parameters are eval-mode BN's with the statistics before the move."""
    from tta_core.model import robust_bn as rb

    calls = []
    fused = rb.normalise_update
    monkeypatch.setattr(rb, "normalise_update", lambda *a: calls.append(1) or fused(*a))
    model = _model().eval()
    bns = _bns(model)
    rbn = rb.RobustBN(bns, 0.1, lag=True)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator().manual_seed(2)
    for grad in (False, True):
        calls.clear()
        for bn in bns:
            before = bn.running_mean.clone(), bn.running_var.clone()
            x = (torch.randn(4, bn.num_features, 16, 16, generator=g) * 2 + 0.5)
            x = x.contiguous(memory_format=fmt).requires_grad_(grad)
            want = nn.functional.batch_norm(x.detach(), *before, bn.weight.detach(),
                                            bn.bias.detach(), False, 0.0, bn.eps)
            with torch.set_grad_enabled(grad):
                y = bn(x)
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
            v, m = torch.var_mean(x.detach(), dim=(0, 2, 3), correction=1)
            torch.testing.assert_close(bn.running_mean, 0.9 * before[0] + 0.1 * m)
            torch.testing.assert_close(bn.running_var, 0.9 * before[1] + 0.1 * v)
            if grad:
                w = torch.randn(y.shape, generator=g).contiguous(memory_format=fmt)
                bn.weight.grad = bn.bias.grad = None
                (y * w).sum().backward()
                ref = [t.detach().clone().requires_grad_() for t in (x, bn.weight, bn.bias)]
                (nn.functional.batch_norm(ref[0], *before, ref[1], ref[2], False, 0.0, bn.eps)
                 * w).sum().backward()
                for got, r in zip((x.grad, bn.weight.grad, bn.bias.grad), ref, strict=True):
                    torch.testing.assert_close(got, r.grad, rtol=1e-4, atol=1e-4)
        assert len(calls) == len(bns)
    rbn.close()


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("track", [False, True])
def test_batch_statistics_layers_give_train_mode_bn(channels_last: bool, track: bool,
                                                    monkeypatch) -> None:
    """A layer on batch statistics under the controller gives PyTorch's train-mode BN:
    its output and, when tracked (the collector's carriers), its running statistics and
    count; one statistics pass per layer without a gradient, PyTorch's own with one."""
    from tta_core.model import robust_bn as rb

    calls = []
    stats = rb.update_stats
    monkeypatch.setattr(rb, "update_stats", lambda *a: calls.append(1) or stats(*a))
    bns, refs = _bns(_model())[:3], _bns(_model())[:3]
    for bn in (*bns, *refs):
        if track:
            bn.train()
            bn.momentum = 0.3
        else:
            rb.use_batch_stats(bn)
    rbn = rb.RobustBN(bns, 0.1, lag=True)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator().manual_seed(3)
    for grad in (False, True):
        calls.clear()
        for bn, ref in zip(bns, refs, strict=True):
            x = (torch.randn(4, bn.num_features, 16, 16, generator=g) * 2 + 0.5)
            x = x.contiguous(memory_format=fmt)
            with torch.set_grad_enabled(grad):
                y, want = bn(x.clone().requires_grad_(grad)), ref(x.clone().requires_grad_(grad))
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
            assert y.is_contiguous(memory_format=fmt)
            if track:
                for a, b in ((bn.running_mean, ref.running_mean),
                             (bn.running_var, ref.running_var)):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
                assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked)
        assert len(calls) == (0 if grad else len(bns))
    rbn.close()


@pytest.mark.parametrize("grad", [False, True])
def test_lag_records_the_statistics_the_layer_normalised_by(grad: bool) -> None:
    """The unit-statistics collector maps the batch statistics through the running ones
    the layer used: with the lag, those from before the move (inside the recorded graph
    too)."""
    from tta_core.model.robust_bn import RobustBN

    model = _model().eval()
    bn = _bns(model)[-1]
    before = bn.running_mean.clone(), bn.running_var.clone()
    rbn = RobustBN([bn], 0.1, lag=True)
    rbn.record = True
    x = torch.randn(4, bn.num_features, 16, 16) + 1.0
    with torch.set_grad_enabled(grad):
        y = bn(x.clone().requires_grad_(grad))
    assert y.requires_grad == grad
    mean, var, used_mean, used_var = rbn.recorded[id(bn)]
    assert not mean.requires_grad
    assert torch.equal(used_mean, before[0]) and torch.equal(used_var, before[1])
    v, m = torch.var_mean(x, dim=(0, 2, 3), correction=0)
    torch.testing.assert_close((mean, var), (m, v), rtol=1e-5, atol=1e-6)
    assert not torch.equal(bn.running_mean, before[0])  # and they moved after
    rbn.close()


@pytest.mark.parametrize("grad", [False, True])
def test_batch_values_put_a_layer_on_the_batch_statistics_where_the_batch_gives_enough(
        grad: bool) -> None:
    """batch_values K: an input with at least K values per channel is normalised by its
    own statistics (train-mode BN's output and gradient), the running statistics moved by
    RoTTA's rule and recorded as normalised by the batch's; below K the layer stays
    lagged robust BN (the running statistics from before the batch)."""
    from tta_core.model.robust_bn import RobustBN

    model = _model().eval()
    bn = _bns(model)[-1]
    c = bn.num_features
    rbn = RobustBN([bn], 0.1, lag=True, batch_values=4 * 8 * 8)
    rbn.record = True
    g = torch.Generator().manual_seed(5)
    for n, on_batch in ((4, True), (3, False)):  # 4 x 8 x 8 values per channel: exactly K
        x = torch.randn(n, c, 8, 8, generator=g) * 2 + 0.5
        mu, var = bn.running_mean.clone(), bn.running_var.clone()
        xa = x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            y = bn(xa)
        ref = nn.BatchNorm2d(c).train()
        ref.load_state_dict({k: v for k, v in bn.state_dict().items()})
        xr = x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            want = (ref(xr) if on_batch else
                    nn.functional.batch_norm(xr, mu, var, bn.weight, bn.bias, False, 0.0,
                                             bn.eps))
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
        if grad:
            w = torch.randn(y.shape, generator=g)
            (gx,) = torch.autograd.grad((y * w).sum(), xa)
            (gr,) = torch.autograd.grad((want * w).sum(), xr)
            torch.testing.assert_close(gx, gr, rtol=1e-4, atol=1e-5)
        v, m = torch.var_mean(x, dim=(0, 2, 3), correction=1)
        torch.testing.assert_close(bn.running_mean, 0.9 * mu + 0.1 * m, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var, 0.9 * var + 0.1 * v, rtol=1e-5, atol=1e-6)
        mean, bvar, used_mean, used_var = rbn.recorded.pop(id(bn))
        vb, mb = torch.var_mean(x, dim=(0, 2, 3), correction=0)
        torch.testing.assert_close((mean, bvar), (mb, vb), rtol=1e-5, atol=1e-6)
        if on_batch:
            assert torch.equal(used_mean, mean) and torch.equal(used_var, bvar)
        else:
            assert torch.equal(used_mean, mu) and torch.equal(used_var, var)
    rbn.close()


def test_batch_values_are_checked() -> None:
    from tta_core.model.robust_bn import RobustBN

    with pytest.raises(ValueError, match=re.escape("batch_values must be 0 (off) or an "
                                                   "integer >= 2, got 1")):
        RobustBN([], 0.1, batch_values=1)
    with pytest.raises(ValueError, match=re.escape("bn_batch_values must be 0 (off) or >= 2, "
                                                   "got 1")):
        build_method("adashadow", _model(), bn_batch_values=1, **CFG)


@pytest.mark.parametrize("lag", [False, True])
def test_frames_momentum_moves_a_large_batch_as_that_many_small_ones(lag: bool) -> None:
    """frames F: a batch of n frames moves the running statistics by 1 - (1 - m)^(n/F)
    (n = F: by m; n = 4F: as four batches of F with its statistics, 1 - 0.9^4); a batch
    of at most F frames is normalised lagged (by the statistics before its move), a larger
    one in RoTTA's order (by the moved ones) even with lag on; frames 0 keeps m per batch."""
    from tta_core.model.robust_bn import RobustBN

    model = _model().eval()
    bn = _bns(model)[-1]
    c = bn.num_features
    g = torch.Generator().manual_seed(7)
    for frames, n, share in ((4, 4, 0.1), (4, 16, 1 - 0.9 ** 4), (4, 2, 1 - 0.9 ** 0.5),
                             (0, 16, 0.1)):
        rbn = RobustBN([bn], 0.1, lag=lag, frames=frames)
        x = torch.randn(n, c, 8, 8, generator=g) * 2 + 0.5
        mu, var = bn.running_mean.clone(), bn.running_var.clone()
        with torch.no_grad():
            y = bn(x)
        v, m = torch.var_mean(x, dim=(0, 2, 3), correction=1)
        moved = ((1 - share) * mu + share * m, (1 - share) * var + share * v)
        torch.testing.assert_close((bn.running_mean, bn.running_var), moved, rtol=1e-5,
                                   atol=1e-6)
        by = (mu, var) if lag and (frames == 0 or n <= frames) else moved
        want = nn.functional.batch_norm(x, *by, bn.weight, bn.bias, False, 0.0, bn.eps)
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-5)
        rbn.close()


def test_frames_and_bn_momentum_batch_are_checked() -> None:
    from tta_core.model.robust_bn import RobustBN

    with pytest.raises(ValueError, match=re.escape("frames must be an integer >= 0 (0: "
                                                   "momentum per batch), got -1")):
        RobustBN([], 0.1, frames=-1)
    with pytest.raises(ValueError, match=re.escape("bn_momentum_batch must be an integer "
                                                   ">= 0 (0: per batch), got 2.5")):
        build_method("adashadow", _model(), bn_momentum_batch=2.5, **CFG)


def test_adashadow_on_many_values_per_channel_serves_the_batch_statistics_model() -> None:
    """With bn_batch_values 2 every layer of a batch normalises by that batch's statistics:
    at lr 0 AdaShadow's answer is the source model's with every BN on batch statistics
    (Tent's forward); with bn_batch_values 0 it is not (robust BN above the bottom
    layers)."""
    from tta_core.model.norms import set_bn_mode

    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 + 0.5
    ref = _model()
    set_bn_mode(ref, "batch")
    with torch.no_grad():
        want = ref(x)
    got = {}
    for k in (2, 0):
        meth = build_method("adashadow", _model(), bn_mode="robust", bn_batch_values=k,
                            lr=0.0, **CFG)
        got[k] = meth.step(x.clone()).logits
    torch.testing.assert_close(got[2], want, rtol=1e-4, atol=1e-4)
    assert (got[0] - want).abs().max() > 1e-2

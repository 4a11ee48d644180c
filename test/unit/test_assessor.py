"""Assessor statistics, Gaussian KL, EMA history, importance ranking and the losses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from tta_core.adashadow.assessor import Assessor, StatsRecorder
from tta_core.runtime.losses import entropy_loss, multilayer_kl_loss
from tta_core.runtime.stats import channel_stats, gaussian_kl


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)

def test_gaussian_kl_closed_form_by_hand() -> None:
    # KL(N(0,1) || N(1,4)) = 0.5*(ln 4 + (1 + 1)/4 - 1) = ln 2 - 0.25
    kl = gaussian_kl(_t(0.0), _t(1.0), _t(1.0), _t(4.0))
    assert kl.item() == pytest.approx(math.log(2.0) - 0.25, rel=1e-12)
    # identical Gaussians -> 0; same variance -> (dmu)^2 / (2 var)
    assert gaussian_kl(_t(3.0), _t(2.0), _t(3.0), _t(2.0)).item() == pytest.approx(0.0, abs=1e-15)
    assert gaussian_kl(_t(0.0), _t(2.0), _t(3.0), _t(2.0)).item() == pytest.approx(9 / 4)
    # KL is asymmetric
    assert gaussian_kl(_t(1.0), _t(4.0), _t(0.0), _t(1.0)).item() != pytest.approx(kl.item())

def test_gaussian_kl_matches_numeric_integration() -> None:
    mu_p, var_p, mu_q, var_q = -0.7, 0.3, 0.4, 1.7
    p = stats.norm(mu_p, math.sqrt(var_p))
    q = stats.norm(mu_q, math.sqrt(var_q))
    numeric, _ = integrate.quad(lambda z: p.pdf(z) * (p.logpdf(z) - q.logpdf(z)), -20, 20)
    kl = gaussian_kl(_t(mu_p), _t(var_p), _t(mu_q), _t(var_q)).item()
    assert kl == pytest.approx(numeric, rel=1e-8)

def test_gaussian_kl_variance_floor() -> None:
    kl = gaussian_kl(_t(0.0), _t(0.0), _t(0.0), _t(1e-5), eps=1e-5)
    assert kl.item() == pytest.approx(0.0, abs=1e-12)
    assert torch.isfinite(gaussian_kl(_t(0.0), _t(0.0), _t(1.0), _t(0.0))).all()

@pytest.mark.parametrize(
    "shape,channel_axis",
    [((5, 7), 1), ((3, 4, 5, 6), 1), ((2, 9, 8), 2), ((1, 3, 2, 2, 2), 1)],
)
@pytest.mark.parametrize("grad", [False, True])  # var_mean path vs BN-stats kernel path
def test_channel_stats_vs_numpy(shape: tuple[int, ...], channel_axis: int, grad: bool) -> None:
    rng = np.random.default_rng(0)
    arr = rng.normal(2.0, 3.0, size=shape)
    mean, var = channel_stats(torch.from_numpy(arr).requires_grad_(grad))
    mean, var = mean.detach(), var.detach()
    axes = tuple(a for a in range(len(shape)) if a != channel_axis)
    np.testing.assert_allclose(mean.numpy(), arr.mean(axis=axes), rtol=1e-12)
    np.testing.assert_allclose(var.numpy(), arr.var(axis=axes), rtol=1e-12)
    assert mean.shape == (shape[channel_axis],)

def test_channel_stats_rejects_1d_and_keeps_grad() -> None:
    with pytest.raises(ValueError, match="ndim"):
        channel_stats(torch.ones(4))
    x = torch.randn(4, 3, requires_grad=True)
    mean, var = channel_stats(x)
    (mean.sum() + var.sum()).backward()
    assert x.grad is not None and x.grad.abs().sum() > 0

def _unit_stats(rng: np.random.Generator, shifts: list[float], n: int = 64) -> list:
    out = []
    for k, shift in enumerate(shifts):
        arr = rng.normal(shift, 1.0 + 0.5 * abs(shift), size=(n, 4 + k, 3, 3))
        out.append(channel_stats(torch.from_numpy(arr).float()))
    return out

def test_first_importance_zero_and_shifted_unit_ranks_higher() -> None:
    rng = np.random.default_rng(1)
    assessor = Assessor(n_units=3)
    first = assessor.step(_unit_stats(rng, [0.0, 0.0, 0.0]))
    np.testing.assert_array_equal(first, np.zeros(3))
    importance = assessor.importance(_unit_stats(rng, [0.1, 2.0, 0.6]))
    assert importance[1] > importance[2] > importance[0] > 0

def test_importance_equals_mean_channel_kl() -> None:
    rng = np.random.default_rng(2)
    assessor = Assessor(n_units=2)
    hist = _unit_stats(rng, [0.0, 0.0])
    assessor.update_history(hist)
    cur = _unit_stats(rng, [0.5, -0.5])
    got = assessor.importance(cur)
    for u in range(2):
        expected = gaussian_kl(hist[u][0], hist[u][1], cur[u][0], cur[u][1]).mean().item()
        assert got[u] == pytest.approx(expected, rel=1e-5)

def test_ema_update_matches_hand_computation() -> None:
    assessor = Assessor(n_units=1, alpha=0.25)
    assessor.update_history([(_t(1.0, 2.0), _t(1.0, 1.0))])
    assessor.update_history([(_t(3.0, 2.0), _t(5.0, 1.0))])
    assessor.update_history([(_t(-1.0, 6.0), _t(1.0, 3.0))])
    mean, var = assessor.history[0]
    # 1 -> 0.75*1 + 0.25*3 = 1.5 -> 0.75*1.5 + 0.25*(-1) = 0.875
    np.testing.assert_allclose(mean.numpy(), [0.875, 0.75 * 2 + 0.25 * 6], rtol=1e-6)
    # 1 -> 0.75 + 1.25 = 2 -> 1.5 + 0.25 = 1.75
    np.testing.assert_allclose(var.numpy(), [1.75, 0.75 + 0.75], rtol=1e-6)

def test_step_equals_importance_then_update() -> None:
    rng = np.random.default_rng(3)
    a, b = Assessor(2), Assessor(2)
    batches = [_unit_stats(rng, [s, -s]) for s in (0.0, 0.3, 0.9)]
    for stats_ in batches:
        via_step = a.step(stats_)
        via_two = b.importance(stats_)
        b.update_history(stats_)
        np.testing.assert_allclose(via_step, via_two, rtol=1e-6)  # EMA(e, e) rounds

def test_state_dict_roundtrip_and_reset() -> None:
    rng = np.random.default_rng(4)
    a = Assessor(2, alpha=0.3)
    a.step(_unit_stats(rng, [0.0, 0.0]))
    a.step(_unit_stats(rng, [1.0, 0.0]))
    saved = a.state_dict()
    probe = _unit_stats(rng, [0.4, 0.4])
    expected = a.importance(probe)
    a.step(_unit_stats(rng, [3.0, 3.0]))  # move away, then restore
    b = Assessor(2)
    b.load_state_dict(saved)
    a.load_state_dict(saved)
    np.testing.assert_allclose(b.importance(probe), expected)
    np.testing.assert_allclose(a.importance(probe), expected)
    assert b.alpha == 0.3
    a.reset()
    assert a.history is None
    np.testing.assert_array_equal(a.importance(probe), np.zeros(2))
    with pytest.raises(ValueError, match="n_units"):
        Assessor(3).load_state_dict(saved)

def test_assessor_rejects_mismatched_stats() -> None:
    a = Assessor(2)
    a.step([(torch.zeros(3), torch.ones(3)), (torch.zeros(4), torch.ones(4))])
    with pytest.raises(ValueError, match="unit 1 has 5 channels"):
        a.importance([(torch.zeros(3), torch.ones(3)), (torch.zeros(5), torch.ones(5))])
    with pytest.raises(ValueError, match="2 units"):
        a.importance([(torch.zeros(3), torch.ones(3))])
    with pytest.raises(ValueError, match="alpha"):
        Assessor(2, alpha=1.5)

def test_multilayer_kl_loss_gradient_and_zero_at_history() -> None:
    rng = np.random.default_rng(5)
    hist = _unit_stats(rng, [0.0, 1.0])
    same = [(m.clone().requires_grad_(), v.clone().requires_grad_()) for m, v in hist]
    assert multilayer_kl_loss(same, hist).item() == pytest.approx(0.0, abs=1e-6)
    x = torch.from_numpy(rng.normal(0.5, 2.0, size=(8, 4, 3, 3))).float().requires_grad_()
    y = torch.from_numpy(rng.normal(1.0, 1.0, size=(8, 5, 3, 3))).float().requires_grad_()
    cur = [channel_stats(x), channel_stats(y)]
    loss = multilayer_kl_loss(cur, hist)
    expected = sum(
        gaussian_kl(h[0], h[1], c[0].detach(), c[1].detach()).mean().item()
        for h, c in zip(hist, cur, strict=True)
    )
    assert loss.item() == pytest.approx(expected, rel=1e-5) and loss.item() > 0
    loss.backward()
    assert x.grad is not None and x.grad.abs().sum() > 0 and y.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="units"):
        multilayer_kl_loss(cur[:1], hist)

def test_entropy_loss() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    assert entropy_loss(logits).item() == pytest.approx(math.log(4) / 2, rel=1e-6)
    p = torch.tensor([0.7, 0.2, 0.1])
    h = -(p * p.log()).sum().item()
    assert entropy_loss(p.log()[None]).item() == pytest.approx(h, rel=1e-6)
    z = torch.randn(3, 5, requires_grad=True)
    entropy_loss(z).backward()
    assert z.grad is not None and z.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="logits"):
        entropy_loss(torch.zeros(3))

def test_channel_stats_cpu_path_survives_cancellation() -> None:
    rng = np.random.default_rng(6)
    arr = (1e4 + 0.1 * rng.standard_normal((4, 3, 8, 8))).astype(np.float32)
    mean, var = channel_stats(torch.from_numpy(arr))
    ref = arr.astype(np.float64)
    np.testing.assert_allclose(var.numpy(), ref.var(axis=(0, 2, 3)), rtol=1e-3)
    np.testing.assert_allclose(mean.numpy(), ref.mean(axis=(0, 2, 3)), rtol=1e-6)
    half = torch.from_numpy(arr[:, :, :2, :2] - 1e4).half()
    _, v16 = channel_stats(half)
    ref16 = half.double().numpy()
    np.testing.assert_allclose(v16.numpy(), ref16.var(axis=(0, 2, 3)), rtol=1e-4)

def _small_net() -> torch.nn.Module:
    torch.manual_seed(0)
    nn = torch.nn
    net = nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
        nn.Conv2d(6, 5, 3), nn.ReLU(), nn.BatchNorm2d(5),  # conv not feeding BN directly
        nn.Flatten(), nn.Linear(5 * 6 * 6, 4),
    )
    with torch.no_grad():  # non-trivial running statistics and affine parameters
        for mod in net.modules():
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.uniform_(-1, 1)
                mod.running_var.uniform_(0.5, 2)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)
                mod.eps = 0.5  # large, so the eps terms of the BN formulas are visible
    return net

@pytest.mark.parametrize("train", [False, True])
def test_stats_recorder_fused_equals_direct(train: bool) -> None:

    net = _small_net().train(train)
    units = [m for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d,
                                                         torch.nn.Linear))]
    x = torch.randn(3, 3, 8, 8) * 2 + 0.5
    outs: list = []
    handles = [m.register_forward_hook(lambda _m, _a, o: outs.append(o.detach())) for m in units]
    with torch.no_grad():
        net(x)
    for h in handles:
        h.remove()
    direct = [torch.var_mean(o, dim=[d for d in range(o.ndim) if d != 1], correction=0)
              for o in outs]
    for fuse in (True, False):
        rec = StatsRecorder(units, fuse_bn=fuse)
        with torch.no_grad(), rec.attach():
            net(x)
        got = rec.stats()
        for (m, v), (v_ref, m_ref) in zip(got, direct, strict=True):
            torch.testing.assert_close(m, m_ref, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-5)

def test_stats_recorder_with_grad_feeds_the_kl_loss() -> None:

    net = _small_net().train()
    units = [m for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.BatchNorm2d))]
    rec = StatsRecorder(units, with_grad=True)
    with rec.attach():
        net(torch.randn(2, 3, 8, 8))
    cur = rec.stats()
    hist = [(m.detach() + 0.3, v.detach() * 1.5) for m, v in cur]
    multilayer_kl_loss(cur, hist).backward()
    assert net[0].weight.grad is not None and net[0].weight.grad.abs().sum() > 0
    assert net[1].weight.grad is not None and net[1].weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="no output"):
        StatsRecorder([*units, torch.nn.Linear(2, 2)]).stats()

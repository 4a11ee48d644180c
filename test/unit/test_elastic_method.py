"""The `elastic` method (issue #22): which size serves a batch under a deadline (against
brute force), a pinned size, refusing a model without gates, and what a step and a
write-back change on a real gated small net. The surrogate/update functions themselves are
tested in test_elastic_surrogate.py / test_elastic_update.py."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tta_core.api import DeadlineTunable, Resizable, TTAMethodLike
from tta_core.elasticdnn.filter_update import _param_masks
from tta_core.elasticdnn.gates import make_gated
from tta_core.elasticdnn.serving import (
    ServingPlan,
    SizeTimes,
    check_sizes,
    choose,
    largest_fitting,
)
from tta_core.model.source import load_source
from tta_core.model.zoo import build_model
from tta_core.registry import build_method
from tta_core.runtime.deadline import DeadlineConfig

SIZES = (1.0, 0.7, 0.5, 0.3)


def gated(seed: int = 0):
    torch.manual_seed(seed)
    return make_gated(build_model("small_resnet", 10))


def batch(seed: int, n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- size choice (pure)
def brute_force(sizes, fwd, upd, deadline, margin, want, pinned):
    """Every (size, adapt) pair; the best feasible one by (size, adapt), else the
    smallest size without update."""
    if pinned is not None:
        cands = [(pinned, a) for a in (False, True)]
    else:
        cands = [(s, a) for s in sizes for a in (False, True)]
    room = deadline - margin

    def ok(s, a):
        if a and not want:
            return False
        t = fwd[s] + (upd[s] if a else 0.0)
        return math.isnan(room) or t <= room or (pinned is not None and not a)

    feasible = [c for c in cands if ok(*c)]
    if pinned is None and not any(not a for _, a in feasible):
        return min(sizes), False
    best_size = max(s for s, a in feasible if not a) if pinned is None else pinned
    return best_size, (best_size, True) in feasible


def test_choice_equals_brute_force_on_random_times() -> None:
    rng = random.Random(0)
    for trial in range(3000):
        sizes = check_sizes(rng.sample([1.0, 0.8, 0.7, 0.5, 0.4, 0.3, 0.2], rng.randint(1, 5)))
        fwd = {s: rng.uniform(0.1, 10.0) for s in sizes}  # not monotone in size on purpose
        upd = {s: rng.uniform(0.0, 20.0) for s in sizes}
        deadline = math.nan if trial % 10 == 0 else rng.uniform(0.0, 30.0)
        margin = rng.uniform(0.0, 3.0)
        want = rng.random() < 0.8
        pinned = rng.choice(sizes) if trial % 7 == 0 else None
        d = choose(sizes, fwd, upd, deadline, margin, want, pinned)
        assert (d.keep, d.adapt) == brute_force(sizes, fwd, upd, deadline, margin, want,
                                                pinned), trial
        assert d.predicted_ms == pytest.approx(fwd[d.keep] + (upd[d.keep] if d.adapt else 0))


def test_largest_fitting_edges() -> None:
    fwd = {1.0: 5.0, 0.5: 2.0, 0.3: 1.0}
    assert largest_fitting((1.0, 0.5, 0.3), fwd, math.nan) == 1.0
    assert largest_fitting((1.0, 0.5, 0.3), fwd, 0.5) == 0.3  # none fits: the fastest
    assert largest_fitting((1.0, 0.5, 0.3), fwd, 2.0) == 0.5  # exactly at the room fits


@pytest.mark.parametrize("bad", [(), (0.0,), (1.5,), (0.5, 0.5), (True,)])
def test_bad_sizes_named(bad) -> None:
    with pytest.raises(ValueError, match="size"):
        check_sizes(bad)


def test_unmeasured_batch_size_predicted_on_the_safe_side() -> None:
    t = SizeTimes()
    t.set_base(0.5, 4, 8.0)  # a + b * n with a > 0: larger batches cost less per frame
    assert t.base_ms(0.5, 2) == 8.0  # a larger batch's time bounds a smaller one's
    assert t.base_ms(0.5, 8) == 16.0  # scaled by n from the largest measured below
    t.set_base(0.5, 2, 5.0)
    assert t.base_ms(0.5, 3) == 8.0 and t.base_ms(0.5, 1) == 5.0


def test_plan_goes_down_under_load_and_back_up_when_it_fits_again() -> None:
    """A deadline of 10 ms: the master (8 ms at warm-up) fits; the machine slows 1.6x
    (served forwards measured slower): 0.7 (6 ms * 1.6 = 9.6) is the largest that fits;
    then it recovers and the master serves again, although it was not run in between."""
    plan = ServingPlan(DeadlineConfig(deadline_mode="fixed", deadline_ms=10.0), SIZES,
                       alpha=0.5)
    plan.fixed.alpha = 0.0  # no margin: the arithmetic alone
    for keep, ms in zip(SIZES, (8.0, 6.0, 4.0, 2.0), strict=True):
        plan.times.set_base(keep, 4, ms)
    served = []
    for slow in [1.0] * 3 + [1.6] * 12 + [1.0] * 12:
        d = plan.decide(4, want_adapt=False)
        served.append(d.keep)
        plan.observe(d, 4, plan.times.base_ms(d.keep, 4) * slow, math.nan)
    assert served[:3] == [1.0] * 3
    assert served[14] == 0.7 and 1.0 not in served[6:15]
    assert served[-1] == 1.0


def test_deadline_left_after_lateness_and_speed() -> None:
    cfg = DeadlineConfig(deadline_mode="camera", camera_hz=100.0)
    plan = ServingPlan(cfg, SIZES)
    for keep, ms in zip(SIZES, (50.0, 30.0, 20.0, 6.0), strict=True):
        plan.times.set_base(keep, 4, ms)
    assert plan.decide(4, False).keep == 0.7  # 40 ms per batch of 4 at 100 Hz
    plan.set_lateness(15.0)
    assert plan.decide(4, False).keep == 0.5  # 25 ms left
    plan.set_lateness(0.0)
    cfg.deadline_mode, cfg.distance_per_decision_m = "speed", 1.0
    plan.set_speed(20.0)
    assert plan.decide(4, False).keep == 1.0  # 1 m at 20 m/s: 50 ms
    plan.set_speed(40.0)
    assert plan.decide(4, False).keep == 0.5  # 25 ms
    plan.set_size(0.3)
    assert plan.decide(4, False).keep == 0.3 and plan.decide(4, False).pinned
    with pytest.raises(ValueError, match=r"0\.4"):
        plan.set_size(0.4)


# ---------------------------------------------------------------- the method
def test_refuses_a_model_without_gates() -> None:
    with pytest.raises(ValueError, match=r"SmallResNet is not a gated master.*train-elastic"):
        build_method("elastic", build_model("small_resnet", 10))


def test_capabilities_and_bad_settings() -> None:
    m = build_method("elastic", gated())
    assert m.size_forward_ms() == {}  # no input_shape: nothing timed before a batch
    m = build_method("elastic", gated(), input_shape=(3, 32, 32), warmup_batch=2)
    assert {b for _, b in m.plan.times.base} == {1, 2} and not m.served
    predicted = m.size_forward_ms()  # timed at build: a fleet can plan before a frame
    assert set(predicted) == set(SIZES) and all(v > 0 for v in predicted.values())
    assert isinstance(m, Resizable) and isinstance(m, DeadlineTunable)
    assert isinstance(m, TTAMethodLike) and m.sizes() == SIZES
    with pytest.raises(ValueError, match="camera_hz"):
        m.set_deadline(deadline_mode="camera", camera_hz=-1.0)
    with pytest.raises(ValueError, match="nope"):
        m.set_deadline(nope=1)
    with pytest.raises(ValueError, match="mass"):
        build_method("elastic", gated(), mass=0.0)


@pytest.mark.parametrize("deadline_ms,size,adapts", [(1e5, 1.0, True), (1e-3, 0.3, False)])
def test_serves_the_master_when_it_fits_and_the_smallest_when_nothing_does(
        deadline_ms: float, size: float, adapts: bool) -> None:
    m = build_method("elastic", gated(), deadline_mode="fixed", deadline_ms=deadline_ms)
    for i in range(6):
        res = m.step(batch(i))
        assert res.stats["size"] == size and res.adapted == adapts == res.stats["adapted"]
        assert res.budget_ms == deadline_ms and res.logits.shape == (4, 10)
    assert set(m.size_forward_ms()) == set(SIZES)


def test_pinned_size_is_honoured_then_released() -> None:
    m = build_method("elastic", gated(), deadline_mode="fixed", deadline_ms=1e5)
    m.step(batch(0))
    m.set_size(0.5)
    assert [m.step(batch(i)).stats["size"] for i in range(1, 5)] == [0.5] * 4
    m.set_size(None)
    assert m.step(batch(5)).stats["size"] == 1.0
    with pytest.raises(ValueError, match=r"0\.6"):
        m.set_size(0.6)


def test_pinned_surrogate_reproduces_the_master_on_the_chosen_sample() -> None:
    """The first batch cuts the surrogates on its highest-entropy sample; before any
    update, a surrogate's forward on that sample is the master's at its sparsity."""
    m = build_method("elastic", gated(), adapt=False)
    x = batch(0)
    m.step(x)
    master = m.model
    for keep, served in m.served.items():
        if keep == 1.0:
            assert served.surrogate.model is master.base
            continue
        errs = []
        for i in range(len(x)):  # one sample at a time: BN normalises by its statistics
            with torch.no_grad(), master.sparsity_set_to(1.0 - keep):
                ref = master(x[i:i + 1])
                out = served.surrogate.model(x[i:i + 1])
            errs.append(float(((out - ref) ** 2).sum()))
        err = torch.tensor(errs)  # one of the four is the chosen sample: there they agree
        assert float(err.min()) < 1e-4, keep


def _changed_entries(before: dict, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach() != before[k] for k, p in model.named_parameters()}


def test_step_changes_only_selected_filters_and_write_back_only_kept_indices() -> None:
    m = build_method("elastic", gated(), lr=0.5, lr_ref_batch=0, rederive_every=0,
                     entropy_jump=0.0, master_update="averaging")
    m.step(batch(0))  # cuts the surrogates (the master adapts at 1.0)
    m.set_size(0.5)
    served = m.served[0.5]
    surrogate = served.surrogate
    before = {k: p.detach().clone() for k, p in surrogate.model.named_parameters()}
    master_before = {k: p.detach().clone() for k, p in m.model.named_parameters()}
    for i in range(1, 4):
        assert m.step(batch(i)).adapted
    allowed = _param_masks(surrogate, served.masks)
    changed = _changed_entries(before, surrogate.model)
    assert any(bool(c.any()) for c in changed.values())
    for name, c in changed.items():
        assert not (c & ~allowed.get(name, torch.zeros_like(c))).any(), name
    assert all(not c.any() for c in _changed_entries(master_before, m.model).values())
    # write-back at the next derivation: the master changes only at the kept indices
    m._derive(batch(9)[:1])
    kept_rows = {s.conv: surrogate.kept[s.conv] for s in surrogate.sites}
    diff = _changed_entries(master_before, m.model)
    assert any(bool(d.any()) for d in diff.values())
    for site in surrogate.sites:
        idx = kept_rows[site.conv]
        for name in (f"base.{site.conv}.weight", f"base.{site.bn}.weight",
                     f"base.{site.bn}.bias"):
            outside = diff[name].clone()
            outside[idx] = False
            assert not outside.any(), name
        nxt = diff[f"base.{site.next_conv}.weight"].clone()
        nxt[:, idx] = False
        assert not nxt.any(), site.next_conv
    touched = {f"base.{n}" for s in surrogate.sites for n in
               (f"{s.conv}.weight", f"{s.conv}.bias", f"{s.bn}.weight", f"{s.bn}.bias",
                f"{s.next_conv}.weight")}
    assert all(not d.any() for k, d in diff.items() if k not in touched), "outside sites"


def test_knowledge_update_moves_the_master_by_the_surrogates_change() -> None:
    """master_update knowledge (default): a master without Θ* gets one fitted (orthonormal
    relevances), so Eqs. 3-4 at the re-cut move the master by the surrogate's whole change
    at the kept indices (2x the averaging rule's) and elsewhere only by float error."""
    runs = {}
    for mode in ("knowledge", "averaging"):
        m = build_method("elastic", gated(), lr=0.5, lr_ref_batch=0, rederive_every=0,
                         entropy_jump=0.0, master_update=mode, sizes=(1.0, 0.5), keep=0.5)
        m.step(batch(0))
        before = {k: p.detach().clone() for k, p in m.model.base.named_parameters()}
        for i in range(1, 3):
            m.step(batch(i))
        m._derive(batch(9)[:1])
        runs[mode] = {k: p.detach() - before[k] for k, p in m.model.base.named_parameters()}
    for k, d in runs["averaging"].items():
        assert torch.allclose(runs["knowledge"][k], 2 * d, atol=1e-5), k
    assert any(bool((d.abs() > 1e-4).any()) for d in runs["averaging"].values())
    with pytest.raises(ValueError, match="master_update must be one of"):
        build_method("elastic", gated(), master_update="half")


def test_master_adapts_in_place_only_at_selected_filters() -> None:
    m = build_method("elastic", gated(), lr=0.5, lr_ref_batch=0)
    before = {k: p.detach().clone() for k, p in m.model.named_parameters()}
    for i in range(3):
        assert m.step(batch(i)).stats["size"] == 1.0
    served = m.served[1.0]
    allowed = {f"base.{k}": v for k, v in _param_masks(served.surrogate, served.masks).items()}
    changed = _changed_entries(before, m.model)
    assert any(bool(c.any()) for c in changed.values())
    for name, c in changed.items():
        assert not (c & ~allowed.get(name, torch.zeros_like(c))).any(), name


def test_without_in_place_the_master_changes_only_at_the_write_back() -> None:
    """master_in_place False: size 1.0 is a cut surrogate (not the master's base); serving
    and adapting it leaves the master bit-identical until the re-cut writes it back."""
    m = build_method("elastic", gated(), lr=0.5, lr_ref_batch=0, rederive_every=0,
                     entropy_jump=0.0, master_update="averaging", master_in_place=False)
    before = {k: p.detach().clone() for k, p in m.model.base.named_parameters()}
    for i in range(3):
        assert m.step(batch(i)).stats["size"] == 1.0
    served = m.served[1.0]
    assert served.adapted and served.surrogate.model is not m.model.base
    assert all(torch.equal(p, before[k]) for k, p in m.model.base.named_parameters())
    m._derive(batch(9)[:1])
    assert any(not torch.equal(p, before[k]) for k, p in m.model.base.named_parameters())


def test_reset_restores_bit_for_bit() -> None:
    m = build_method("elastic", gated(), lr=0.2, lr_ref_batch=0)
    state = {k: v.clone() for k, v in m.model.state_dict().items()}
    xs = [batch(i) for i in range(3)]
    first = [m.step(x).logits for x in xs]
    m.reset()
    assert all(torch.equal(v, state[k]) for k, v in m.model.state_dict().items())
    again = [m.step(x).logits for x in xs]
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)


def test_entropy_jump_rederives_and_writes_back() -> None:
    """The shipped small net (gated, gates at 1): noise batches, then smooth images, whose
    predictions are surer by ~0.3 nats: the jump re-derives, writing the adapted
    surrogate back into the master."""
    base, _ = load_source("checkpoints/small_resnet_signs32.json")
    m = build_method("elastic", make_gated(base), lr=0.2, lr_ref_batch=0, rederive_every=0,
                     entropy_jump=0.15)
    m.step(batch(0))
    m.set_size(0.5)
    master_before = {k: p.detach().clone() for k, p in m.model.named_parameters()}
    calm = [m.step(batch(i)) for i in range(1, 6)]
    assert not any(r.stats["rederived"] for r in calm)
    assert all(torch.equal(p, master_before[k]) for k, p in m.model.named_parameters())
    smooth = [torch.nn.functional.interpolate(batch(20 + i)[:, :, :4, :4], size=32)
              for i in range(10)]  # another domain: smooth images
    shifted = [m.step(x).stats["rederived"] for x in smooth]
    assert any(shifted)
    assert any(not torch.equal(p, master_before[k]) for k, p in m.model.named_parameters())


def test_keep_in_the_config_pins_the_size_from_the_first_batch() -> None:
    """`keep` (the node's method.keep) serves that size from the first batch on; a size
    the method does not serve is refused at build with the value named."""
    meth = build_method("elastic", gated(), keep=0.5, sizes=(1.0, 0.5), warmup_runs=1)
    res = meth.step(torch.randn(4, 3, 32, 32))
    assert res.stats["size"] == 0.5 and res.stats["pinned"]
    meth.set_size(None)
    assert meth.config.keep is None
    with pytest.raises(ValueError, match=r"keep 0\.3 is not one of the sizes"):
        build_method("elastic", gated(), keep=0.3, sizes=(1.0, 0.5))


def test_retrain_time_per_size_from_measured_update_steps() -> None:
    """Retrains.size_retrain_ms: retrain_steps x (forward + update) of each size, the
    update from that size's measured ratio; NaN for a size that never adapted."""
    from tta_core.api import Retrains

    m = build_method("elastic", gated(), deadline_mode="fixed", deadline_ms=1e5,
                     retrain_steps=5)
    assert isinstance(m, Retrains) and m.size_retrain_ms() == {}  # nothing timed yet
    m.set_size(0.5)
    for i in range(3):
        assert m.step(batch(i)).adapted
    t = m.size_retrain_ms()
    assert math.isfinite(t[0.5]) and t[0.5] > 0
    assert all(math.isnan(t[k]) for k in SIZES if k != 0.5)  # never adapted
    times = m.plan.times  # planted: base 10 ms at batch 4, load 1.5, update 3 x forward
    for k in SIZES:
        times.set_base(k, 4, 10.0 * k)
    times.load, times.update_ratio = 1.5, {0.5: 3.0, 1.0: 2.0}
    t = m.size_retrain_ms()
    assert t[0.5] == pytest.approx(5 * 5.0 * 1.5 * 4.0)  # 150 ms
    assert t[1.0] == pytest.approx(5 * 10.0 * 1.5 * 3.0)  # 225 ms
    assert math.isnan(t[0.7]) and math.isnan(t[0.3])
    lr0 = build_method("elastic", gated(), deadline_mode="fixed", deadline_ms=1e5, lr=0.0)
    lr0.step(batch(0))
    assert all(math.isnan(v) for v in lr0.size_retrain_ms().values())  # serve only
    with pytest.raises(ValueError, match=r"retrain_steps must be an integer >= 1, got 0"):
        build_method("elastic", gated(), retrain_steps=0)


def test_domain_representation_is_an_ema_of_served_penultimate_features() -> None:
    """The served network's mean input to its last Linear layer, EMA weight REP_ALPHA
    over batches; None before a batch and after a reset."""
    from tta_core.elasticdnn.method import REP_ALPHA

    m = build_method("elastic", gated(), deadline_mode="fixed", deadline_ms=1e5, lr=0.0)
    assert m.domain_representation() is None
    feats: list[torch.Tensor] = []
    x0, x1 = batch(0), batch(1)
    m.step(x0)  # the master serves (size 1.0, no update)
    hook = m.model.base.fc.register_forward_hook(lambda _m, i, _o: feats.append(i[0]))
    with torch.no_grad():
        m.model.base(x0)
        m.model.base(x1)
    hook.remove()
    r0 = feats[0].mean(0).double().numpy()
    assert m.domain_representation() == pytest.approx(r0, rel=1e-5, abs=1e-6)
    m.step(x1)
    expected = (1 - REP_ALPHA) * r0 + REP_ALPHA * feats[1].mean(0).double().numpy()
    assert m.domain_representation() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    m.reset()
    assert m.domain_representation() is None

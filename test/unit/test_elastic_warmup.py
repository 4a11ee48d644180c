"""The elastic method's warm-up (api.WarmsUp, issue #22): before the first real batch it
cuts the surrogates and learns its times, and leaves every weight, BN statistic, mask,
optimizer and the entropy watch as it found them; the first real batch then cuts nothing.
Also: a re-cut that nothing adapted before is never forced (it would only re-pick filters).
The streaming effect (the first batch in time) is in test_elastic_streaming.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import tta_core.elasticdnn.method as elastic
from tta_core.api import WarmsUp
from tta_core.elasticdnn.gates import make_gated
from tta_core.elasticdnn.surrogate import extract_surrogate, highest_entropy_sample
from tta_core.model.norms import set_bn_mode
from tta_core.model.zoo import build_model
from tta_core.registry import build_method


def gated(seed: int = 0):
    torch.manual_seed(seed)
    return make_gated(build_model("small_resnet", 10))


def batch(seed: int, n: int = 4) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("deadline", [{"deadline_mode": "sigma"},
                                      {"deadline_mode": "fixed", "deadline_ms": 1e5}])
def test_warm_up_restores_every_weight_and_statistic_bit_for_bit(deadline) -> None:
    """Updates of every size and planned batches run during the warm-up (the master
    adapts in both settings: no deadline / a loose one), yet the master's state_dict
    (weights, gates, BN running statistics) is bit-identical afterwards and each surrogate
    equals a fresh cut of the untouched master from the warm-up batch's sample."""
    m = build_method("elastic", gated(), lr=0.5, lr_ref_batch=0, **deadline)
    pristine = copy.deepcopy(m.model)
    before = state(m.model)
    x = batch(1)
    assert isinstance(m, WarmsUp)
    m.warm_up(x)
    assert_same(state(m.model), before)
    sample = highest_entropy_sample(pristine, x)
    for keep, served in m.served.items():
        assert served.optimizer is None and not served.hooks and not served.masks
        assert not served.adapted
        if keep < 1.0:
            fresh = extract_surrogate(pristine, sample, keep).model
            set_bn_mode(fresh, m.config.bn_mode)
            assert_same(state(served.surrogate.model), state(fresh))
    assert m.optimizer is None and not m.watch.ema and m.since_derive == 0 and not m.pending
    # the warm-up did adapt (else the test would prove nothing): every size's update
    # cost was measured, and the cut's
    assert set(m.plan.times.update_ratio) == set(m.sizes())
    assert math.isfinite(m.plan.rederive_ms) and m.plan.times.measured(4)


def test_warm_up_teaches_the_margin_under_a_deadline() -> None:
    """Under a deadline the warm-up's planned batches feed the margin (FixedCosts) before
    the first real batch; without warm-up it starts from nothing."""
    cold = build_method("elastic", gated(), deadline_mode="fixed", deadline_ms=1e5)
    warm = build_method("elastic", gated(), deadline_mode="fixed", deadline_ms=1e5)
    warm.warm_up(batch(1))
    assert warm.plan.fixed.total_updates > cold.plan.fixed.total_updates == 0


def test_first_real_batch_cuts_nothing(monkeypatch) -> None:
    """After warm_up the surrogates are there: the first real batch is served by them,
    no cut runs (extract_surrogate would raise) and it does not report a re-derivation."""
    m = build_method("elastic", gated(), deadline_mode="fixed", deadline_ms=1e-3)
    m.warm_up(batch(1))
    cut = {k: s.surrogate for k, s in m.served.items()}

    def no_cut(*args, **kwargs):
        raise AssertionError("a surrogate was cut on the first real batch")

    monkeypatch.setattr(elastic, "extract_surrogate", no_cut)
    res = m.step(batch(2))
    assert res.stats["size"] == 0.3 and not res.stats["rederived"]
    assert all(m.served[k].surrogate is s for k, s in cut.items())
    with torch.no_grad():
        assert torch.equal(res.logits, cut[0.3].model(batch(2)))


def test_warm_up_without_updates_changes_no_weight() -> None:
    """adapt=False: no update is timed (no ratio learnt), the state is untouched too."""
    m = build_method("elastic", gated(), adapt=False)
    before = state(m.model)
    m.warm_up(batch(1))
    assert_same(state(m.model), before)
    assert not m.plan.times.update_ratio and len(m.served) == 4


def test_an_overdue_recut_is_forced_only_when_something_adapted() -> None:
    """Under a deadline nothing fits beside the forward (no room for a re-cut): with
    nothing adapted, a due re-cut is never forced; once a size has adapted (its change
    must be written back), it is forced 2 x rederive_every batches after the last cut."""
    m = build_method("elastic", gated(), deadline_mode="fixed", deadline_ms=1e-3,
                     rederive_every=2, entropy_jump=0.0)
    m.warm_up(batch(1))
    assert not any(m.step(batch(i)).stats["rederived"] for i in range(2, 10))
    m.served[0.3].adapted = True  # as if it had adapted before the deadline tightened
    flags = [m.step(batch(i)).stats["rederived"] for i in range(10, 14)]
    assert flags[0] and not m.served[0.3].adapted  # forced at once (overdue), written back

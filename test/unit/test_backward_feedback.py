"""The closed-loop backward correction (tta_core.runtime.backward_feedback) and how
predictor.planning_times applies it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tta_core.adashadow.predictor import UnitProfile, planning_times
from tta_core.runtime.backward_feedback import BackwardFeedback


def test_converges_to_a_constant_misprediction_and_tracks_a_change() -> None:
    fb = BackwardFeedback(alpha=0.3)
    uncorrected = 10.0
    for _ in range(40):  # the machine runs the backward 1.3x slower than predicted
        fb.update(uncorrected * fb.factor, 1.3 * uncorrected)
    assert fb.factor == pytest.approx(1.3, rel=1e-4) and fb.updates == 40
    for _ in range(40):  # now 0.8x: the factor follows
        fb.update(uncorrected * fb.factor, 0.8 * uncorrected)
    assert fb.factor == pytest.approx(0.8, rel=1e-4)


def test_one_step_is_the_ema_in_log_space_and_outliers_are_clipped() -> None:
    fb = BackwardFeedback(alpha=0.25, factor=2.0)
    # predicted 20 ms with factor 2 (10 ms uncorrected), measured 40 ms: evidence 4
    fb.update(20.0, 40.0)
    assert fb.factor == pytest.approx(math.exp(0.75 * math.log(2.0) + 0.25 * math.log(4.0)))
    spike = BackwardFeedback(alpha=1.0, max_factor=3.0)
    assert spike.update(1.0, 1000.0) == pytest.approx(3.0)  # one preempted batch
    assert spike.update(1000.0 * 3.0, 1.0) == pytest.approx(1 / 3.0)


@pytest.mark.parametrize("pred,meas", [(float("nan"), 1.0), (1.0, float("nan")), (0.0, 1.0),
                                       (1.0, 0.0), (-1.0, 2.0), (1.0, float("inf"))])
def test_pairs_without_a_backward_are_ignored(pred: float, meas: float) -> None:
    fb = BackwardFeedback()
    assert fb.update(pred, meas) == 1.0 and fb.updates == 0


def test_alpha_zero_is_off_and_bad_settings_are_refused() -> None:
    fb = BackwardFeedback(alpha=0.0)
    assert fb.update(1.0, 5.0) == 1.0
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="alpha must be in"):
            BackwardFeedback(alpha=bad)
    with pytest.raises(ValueError, match="max_factor"):
        BackwardFeedback(max_factor=0.5)
    fb = BackwardFeedback(alpha=1.0)
    fb.update(1.0, 2.0)
    fb.reset()
    assert (fb.factor, fb.updates) == (1.0, 0)


def test_planning_times_scale_backward_not_reforward() -> None:
    n = 5
    prof = UnitProfile(model="m", device="cpu", batch_size=2, input_shape=(3, 8, 8),
                       unit_names=[f"u{i}" for i in range(n)], w_ms=np.arange(1.0, n + 1),
                       x_ms=np.full(n, 0.5), r_ms=np.full(n, 2.0), eta=np.ones(n),
                       forward_ms=10.0)
    w0, x0, r0 = planning_times(prof, 1.0, 1.0, 20.0, "uniform")
    w, x, r = planning_times(prof, 1.0, 1.0, 20.0, "uniform", backward_factor=1.5)
    np.testing.assert_allclose(w, 1.5 * w0)
    np.testing.assert_allclose(x, 1.5 * x0)
    np.testing.assert_allclose(r, r0)  # the forward feedback already fits r: 2x here
    np.testing.assert_allclose(r0, 4.0)
    with pytest.raises(ValueError, match="backward_factor"):
        planning_times(prof, 1.0, 1.0, 20.0, "uniform", backward_factor=0.0)

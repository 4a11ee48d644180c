"""tta_core.elasticdnn.accuracy_estimate: ElasticDNN Eq. 5-7 against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tta_core.elasticdnn.accuracy_estimate import (
    AccuracyHistory,
    calibrate,
    distance_weights,
    domain_distance,
)

# two past domains at distances 1 and 2: inverses 1 and 0.5, softmax (Eq. 5)
W1 = 1.0 / (1.0 + math.exp(-0.5))  # e^1 / (e^1 + e^0.5) = 0.62246
W2 = 1.0 - W1  # 0.37754


def test_eq5_softmax_of_inverse_distances() -> None:
    assert distance_weights([1.0, 2.0]) == pytest.approx([0.6224593312, 0.3775406688])
    assert distance_weights([1.0, 2.0]) == pytest.approx([W1, W2])
    assert distance_weights([3.0]) == pytest.approx([1.0])
    # a past domain at distance 0 takes every weight (the softmax's limit)
    assert distance_weights([0.5, 0.0, 0.0]).tolist() == [0.0, 0.5, 0.5]
    with pytest.raises(ValueError, match=r"-1\.0"):
        distance_weights([1.0, -1.0])
    with pytest.raises(ValueError, match="non-empty"):
        distance_weights([])


def test_eq6_and_eq7_half_initial_half_weighted_past() -> None:
    # Eq. 6: A = 0.8 / 2 + (0.62246 * 0.9 + 0.37754 * 0.5) / 2 = 0.77449 (size 1), 0.57449
    before = calibrate([0.8, 0.6], [[0.9, 0.7], [0.5, 0.3]], [1.0, 2.0])
    assert before == pytest.approx([0.7744918662, 0.5744918662])
    # Eq. 7: Ã = 0.9 / 2 + (0.62246 * 0.95 + 0.37754 * 0.7) / 2 = 0.87781, and 0.79337
    after = calibrate([0.9, 0.8], [[0.95, 0.9], [0.7, 0.6]], [1.0, 2.0])
    assert after == pytest.approx([0.8778074164, 0.7933688997])
    # k = 1: no past domain, the prediction unchanged
    assert calibrate([0.3, 0.2], [], []) == pytest.approx([0.3, 0.2])
    # a matrix per application and size: the same, element-wise
    m = calibrate(np.full((2, 3), 0.5), np.stack([np.ones((2, 3)), np.zeros((2, 3))]),
                  [1.0, 2.0])
    assert m == pytest.approx(np.full((2, 3), 0.25 + 0.5 * W1))
    with pytest.raises(ValueError, match="expected"):
        calibrate([0.8, 0.6], [[0.9], [0.5]], [1.0, 2.0])


def test_history_estimates_a_new_domain_from_the_near_past_ones() -> None:
    h = AccuracyHistory()
    rep0 = np.zeros(4)
    # no past domain yet: the initial prediction
    b, a = h.estimate(rep0, [0.8, 0.6], [0.9, 0.8])
    assert b == pytest.approx([0.8, 0.6]) and a == pytest.approx([0.9, 0.8])
    assert h.gain_prior(rep0) == 0.0
    h.record([1.0, 0, 0, 0], [0.9, 0.7], [0.95, 0.9])  # distance 1 from rep0
    h.record([0, 2.0, 0, 0], [0.5, 0.3], [0.7, 0.6])  # distance 2
    assert h.distances(rep0) == pytest.approx([1.0, 2.0])
    assert domain_distance([0, 3], [4, 0]) == pytest.approx(5.0)
    b, a = h.estimate(rep0, [0.8, 0.6], [0.9, 0.8])
    assert b == pytest.approx([0.7744918662, 0.5744918662])
    assert a == pytest.approx([0.8778074164, 0.7933688997])
    # weighted retraining gain: 0.62246 * (0.05, 0.2) + 0.37754 * (0.2, 0.3)
    assert h.gain_prior(rep0) == pytest.approx([W1 * 0.05 + W2 * 0.2, W1 * 0.2 + W2 * 0.3])
    with pytest.raises(ValueError, match="shape"):
        h.estimate(np.zeros(3), [0.8, 0.6], [0.9, 0.8])
    with pytest.raises(ValueError, match="finite"):
        h.record(rep0, [0.5, math.nan], [0.5, 0.5])


def test_label_free_estimate_from_the_proxy_and_past_gains() -> None:
    """Initial A = the proxy, initial Ã = proxy + the weighted past gain (clipped), both
    calibrated by Eq. 6-7; past domains at distances 1 and 2 (weights W1, W2)."""
    h = AccuracyHistory()
    h.record([1.0, 0.0], [0.6, 0.5], [0.8, 0.6])  # gains 0.2, 0.1
    h.record([0.0, 2.0], [0.4, 0.3], [0.5, 0.9])  # gains 0.1, 0.6
    proxy = [0.5, 0.8]
    gain = np.array([W1 * 0.2 + W2 * 0.1, W1 * 0.1 + W2 * 0.6])
    after0 = np.minimum(np.array(proxy) + gain, 1.0)
    a, b = h.label_free([0.0, 0.0], proxy)
    assert a == pytest.approx([0.25 + (W1 * 0.6 + W2 * 0.4) / 2,
                               0.4 + (W1 * 0.5 + W2 * 0.3) / 2])
    assert b == pytest.approx(after0 / 2 + np.array([W1 * 0.8 + W2 * 0.5,
                                                      W1 * 0.6 + W2 * 0.9]) / 2)
    assert b[1] == pytest.approx(0.5 + (W1 * 0.6 + W2 * 0.9) / 2)  # 0.8 + gain > 1: clipped
    # unknown without a past domain, a proxy or a representation
    for hist, rep, prox in ((AccuracyHistory(), [0.0, 0.0], proxy), (h, [0.0, 0.0],
                            [0.5, math.nan]), (h, [math.nan, 0.0], proxy)):
        a, b = hist.label_free(rep, prox)
        assert np.isnan(a).all() and np.isnan(b).all() and a.shape == (2,)


def test_history_records_round_trip_by_size() -> None:
    h = AccuracyHistory()
    h.record([1.0, 2.0], [0.6, 0.5], [0.8, 0.6])
    records = h.to_records([1.0, 0.5])
    assert records == [{"representation": [1.0, 2.0], "before": {"1.0": 0.6, "0.5": 0.5},
                        "after": {"1.0": 0.8, "0.5": 0.6}}]
    back = AccuracyHistory.from_records(records, [0.5, 1.0])  # another size order
    assert back.domains[0].before.tolist() == [0.5, 0.6]
    assert back.domains[0].after.tolist() == [0.6, 0.8]
    with pytest.raises(ValueError, match=r"past domain 0: .*sizes \[1\.0, 0\.3\]"):
        AccuracyHistory.from_records(records, [1.0, 0.3])

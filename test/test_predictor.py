"""Runtime latency predictor: Eq. 4 scaling, expansion coefficients, profile JSON."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from tta_core.predictor import (
    PROFILE_SCHEMA,
    Calibration,
    UnitProfile,
    compute_expansion,
    eta_from_macs,
    memory_expansion,
    runtime_times,
)


def _profile(n: int = 4, seed: int = 0) -> UnitProfile:
    rng = np.random.default_rng(seed)
    return UnitProfile(
        model="resnet50", device="cpu-test", batch_size=4, input_shape=(3, 224, 224),
        unit_names=[f"layer.{i}" for i in range(n)],
        w_ms=rng.uniform(0.1, 3, n), x_ms=rng.uniform(0.1, 3, n), r_ms=rng.uniform(0.1, 1, n),
        eta=rng.uniform(0.1, 10, n), forward_ms=12.5,
    )


def test_runtime_times_match_eq4_by_hand() -> None:
    p = UnitProfile(
        model="m", device="d", batch_size=1, input_shape=(3, 8, 8), unit_names=["a", "b"],
        w_ms=np.array([2.0, 1.0]), x_ms=np.array([4.0, 0.5]), r_ms=np.array([1.0, 3.0]),
        eta=np.array([3.0, 0.0]), forward_ms=1.0,
    )
    w, x, r = runtime_times(p, pi1=2.0, pi2=1.5)
    # unit a: eta 3 -> 2*3/4 + 1.5/4 = 1.875 ; unit b: eta 0 -> pure memory -> 1.5
    np.testing.assert_allclose(w, [2.0 * 1.875, 1.0 * 1.5])
    np.testing.assert_allclose(x, [4.0 * 1.875, 0.5 * 1.5])
    np.testing.assert_allclose(r, [1.0 * 1.875, 3.0 * 1.5])


def test_offline_conditions_give_offline_times_exactly() -> None:
    p = _profile()
    cal = Calibration(f_slope=0.3, f_intercept=0.0, b_ratio=4.0,
                      freq_offline_mhz=1400.0, cache_hit_offline=0.9)
    pi1 = compute_expansion(1400.0, 0, cal)
    pi2 = memory_expansion(0.9, cal)
    assert pi1 == 1.0 and pi2 == 1.0
    w, x, r = runtime_times(p, pi1, pi2)
    np.testing.assert_array_equal(w, p.w_ms)
    np.testing.assert_array_equal(x, p.x_ms)
    np.testing.assert_array_equal(r, p.r_ms)


def test_compute_expansion_formula_and_unknown_frequency() -> None:
    cal = Calibration(f_slope=0.25, f_intercept=0.1, freq_offline_mhz=2000.0)
    assert compute_expansion(1000.0, 3, cal) == pytest.approx(2.0 * (1 + 0.75 + 0.1))
    assert compute_expansion(float("nan"), 2, cal) == pytest.approx(1 + 0.5 + 0.1)
    assert compute_expansion(None, 0, cal) == pytest.approx(1.1)
    assert compute_expansion(1000.0, float("nan"), cal) == pytest.approx(2.0 * 1.1)
    no_off = Calibration(f_slope=0.25)
    assert compute_expansion(1000.0, 2, no_off) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="competing"):
        compute_expansion(1000.0, -1, cal)


def test_memory_expansion_formula() -> None:
    cal = Calibration(b_ratio=5.0, cache_hit_offline=0.8)
    offline = 0.8 + 0.2 * 5.0
    assert memory_expansion(0.3, cal) == pytest.approx((0.3 + 0.7 * 5.0) / offline)
    assert memory_expansion(float("nan"), cal) == 1.0
    raw = Calibration(b_ratio=5.0)  # offline hit rate unknown: the paper's unnormalised form
    assert memory_expansion(0.3, raw) == pytest.approx(0.3 + 0.7 * 5.0)
    with pytest.raises(ValueError, match="cache_hit_rate"):
        memory_expansion(1.2, cal)


def test_predicted_time_grows_with_competing_processes_and_misses() -> None:
    p = _profile(6, seed=1)
    cal = Calibration(f_slope=0.2, b_ratio=3.0, freq_offline_mhz=1500.0, cache_hit_offline=0.95)
    totals = []
    for n in range(6):
        w, x, r = runtime_times(p, compute_expansion(1500.0, n, cal), 1.0)
        totals.append(w.sum() + x.sum() + r.sum())
    assert all(b > a for a, b in itertools.pairwise(totals))
    pis = [memory_expansion(phi, cal) for phi in (0.95, 0.7, 0.4, 0.1)]
    assert all(b > a for a, b in itertools.pairwise(pis))
    # lower clock (thermal throttling) -> slower
    assert compute_expansion(750.0, 0, cal) == pytest.approx(2.0)


def test_eta_from_macs() -> None:
    eta = eta_from_macs(np.array([1e9, 2e6]), np.array([4e6, 8e6]), 1e11, 2e10)
    # (1e9/1e11) / (4e6/2e10) = 0.01 / 2e-4 = 50 ; (2e6/1e11)/(8e6/2e10) = 2e-5/4e-4 = 0.05
    np.testing.assert_allclose(eta, [50.0, 0.05])
    with pytest.raises(ValueError, match="bytes_moved"):
        eta_from_macs(1.0, 0.0, 1e11, 2e10)
    with pytest.raises(ValueError, match="flops_per_s"):
        eta_from_macs(1.0, 1.0, 0.0, 2e10)


def test_profile_json_roundtrip(tmp_path) -> None:
    p = _profile(5)
    path = tmp_path / "profiles" / "resnet50.json"
    p.save(path)
    q = UnitProfile.load(path)
    assert q.unit_names == p.unit_names and q.input_shape == (3, 224, 224)
    for name in ("w_ms", "x_ms", "r_ms", "eta"):
        np.testing.assert_array_equal(getattr(q, name), getattr(p, name))
    assert q.forward_ms == p.forward_ms and q.batch_size == 4 and q.model == "resnet50"
    assert json.loads(path.read_text())["schema"] == PROFILE_SCHEMA


def test_profile_rejects_wrong_schema_and_units(tmp_path) -> None:
    p = _profile(3)
    data = p.to_dict()
    data["schema"] = "tta.unit_profile/0"
    with pytest.raises(ValueError, match="schema"):
        UnitProfile.from_dict(data)
    p.check_units(["layer.0", "layer.1", "layer.2"])
    with pytest.raises(ValueError, match=r"profile unit 1 is 'layer\.1'"):
        p.check_units(["layer.0", "conv1", "layer.2"])
    with pytest.raises(ValueError, match="has 3 units, model has 2"):
        p.check_units(["layer.0", "layer.1"])
    bad = p.to_dict()
    bad["w_ms"] = [1.0, -1.0, 1.0]
    bad.pop("schema")
    with pytest.raises(ValueError, match="w_ms"):
        UnitProfile(**bad)
    with pytest.raises(ValueError, match="pi1"):
        runtime_times(p, float("nan"), 1.0)
    with pytest.raises(ValueError, match="b_ratio"):
        Calibration(b_ratio=math.inf)

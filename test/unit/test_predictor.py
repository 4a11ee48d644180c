"""Runtime latency predictor: Eq. 4 scaling, expansion coefficients (predictor's paper
formulas and tta_core.adashadow.expansion's models), profile JSON."""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import replace

import numpy as np
import pytest

from tta_core.adashadow.expansion import (
    Expansion,
    ExpansionModel,
    OfflineReference,
    estimate_pi2,
    relative_pi1,
    round_robin_share,
    share_pis,
)
from tta_core.adashadow.predictor import (
    PROFILE_SCHEMA,
    Calibration,
    UnitProfile,
    compute_expansion,
    eta_from_macs,
    memory_expansion,
    runtime_times,
)
from tta_core.telemetry import ResourceSample

NAN = math.nan


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


# ---------------------------------------------------------------- tta_core.adashadow.expansion
def _ref(competing: float = 0.0, bw: float = 30.0, freq: float = NAN,
         hit: float = NAN) -> OfflineReference:
    return OfflineReference(competing=competing, freq_mhz=freq, cache_hit_rate=hit,
                            probe_bw_gbs=bw)


def _sample(n: float = NAN, freq: float = NAN, hit: float = NAN) -> ResourceSample:
    return ResourceSample(competing_processes=n, cpu_freq_mhz=freq, cache_hit_rate=hit)


def test_round_robin_share_and_share_pis_by_hand() -> None:
    # 1 thread on 2 cores: one competitor fits on the free core, three share 2 cores by 4
    assert round_robin_share(1, _ref(0), threads=1, cores=2) == 1.0
    assert round_robin_share(3, _ref(0), threads=1, cores=2) == 2.0
    assert round_robin_share(5, _ref(1), threads=1, cores=2) == 3.0
    # T = C: the line 1 + n / C through the origin, relative to n_off
    assert round_robin_share(2, _ref(0), threads=2, cores=2) == 2.0
    assert round_robin_share(4, _ref(2), threads=2, cores=2) == 1.5
    assert round_robin_share(2, _ref(NAN), threads=2, cores=2) == 2.0  # unknown n_off = 0
    # sharing scales compute and memory; DVFS 2000 -> 1000 MHz doubles compute only
    assert share_pis(1000.0, 3, 1.25, _ref(0, freq=2000.0), 1, 2) == (4.0, 2.5)
    assert share_pis(NAN, 3, 1.25, _ref(0, freq=2000.0), 1, 2) == (2.0, 2.5)
    with pytest.raises(ValueError, match="cores"):
        round_robin_share(1, _ref(), threads=1, cores=0)


def test_relative_pi1_and_pi2_by_hand() -> None:
    cal = Calibration(f_slope=0.5, b_ratio=4.0, cache_hit_offline=0.9)
    assert relative_pi1(NAN, 2, _ref(0), cal) == pytest.approx(2.0)
    assert relative_pi1(NAN, 3, _ref(1), cal) == pytest.approx(2.5 / 1.5)
    assert relative_pi1(NAN, 1, _ref(1), cal) == pytest.approx(1.0)
    pi2, src = estimate_pi2(0.6, 10.0, _ref(bw=30.0), cal, "probe")  # phi known wins
    assert (pi2, src) == (pytest.approx(memory_expansion(0.6, cal)), "perf")
    assert pi2 == pytest.approx((0.6 + 0.4 * 4) / (0.9 + 0.1 * 4))
    # the reference's own hit rate, when known, normalises instead of the calibration's
    pi2, _ = estimate_pi2(0.6, NAN, _ref(hit=0.8), cal, "perf")
    assert pi2 == pytest.approx((0.6 + 0.4 * 4) / (0.8 + 0.2 * 4))
    # no hit rate: the probe gives b_off / b_now
    assert estimate_pi2(NAN, 10.0, _ref(bw=30.0), cal, "probe") == (3.0, "probe")
    assert estimate_pi2(NAN, 40.0, _ref(bw=30.0), cal, "probe") == (1.0, "probe")  # noise
    assert estimate_pi2(NAN, 10.0, _ref(bw=30.0), cal, "perf") == (1.0, "none")
    assert estimate_pi2(NAN, 10.0, _ref(bw=NAN), cal, "probe") == (1.0, "none")
    assert estimate_pi2(NAN, 0.0, _ref(bw=30.0), cal, "probe") == (1.0, "none")


def test_share_model_by_hand_relative_to_n_off() -> None:
    cal = Calibration(f_slope=0.5, b_ratio=4.0)
    share = ExpansionModel("share", cal, threads=1, cores=2)
    assert share.pis(_sample(n=1)) == (1.0, 1.0)  # the free core: no slowdown
    assert share.pis(_sample(n=3)) == (2.0, 2.0)  # 4 runnable on 2 cores: twice as long
    busy_off = ExpansionModel("share", cal, _ref(competing=1), threads=1, cores=2)
    assert busy_off.pis(_sample(n=1)) == (1.0, 1.0)  # as loaded as the offline run
    assert busy_off.pis(_sample(n=5)) == (3.0, 3.0)
    ex = ExpansionModel("share", cal, _ref(bw=30.0, freq=2000.0), threads=1, cores=2).evaluate(
        _sample(n=3, freq=1000.0), probe_bw_gbs=20.0)
    assert ex == Expansion(pi1=4.0, pi2=3.0, share=2.0, pi2_mem=1.5, pi2_source="probe",
                           competing=3.0, probe_bw_gbs=20.0)


def test_paper_model_is_the_old_compute_expansion_path() -> None:
    """n_off = 0 and f through the origin: exactly predictor.compute/memory_expansion."""
    cal = Calibration(f_slope=0.3, b_ratio=5.0, freq_offline_mhz=2000.0, cache_hit_offline=0.8)
    paper = ExpansionModel("paper", cal, threads=1, cores=2)
    for n, freq, hit in ((0, 2000.0, 0.8), (3, 1000.0, 0.4), (2, NAN, NAN), (NAN, 1500.0, 0.9)):
        want = (compute_expansion(freq, n, cal), memory_expansion(hit, cal))
        assert paper.pis(_sample(n, freq, hit)) == pytest.approx(want), (n, freq, hit)
    # relative to a busy calibration run: (1 + f(n)) / (1 + f(n_off))
    busy = ExpansionModel("paper", replace(cal, n_off=1.0), threads=1, cores=2)
    assert busy.pis(_sample(3, 2000.0, 0.8)) == pytest.approx((1.9 / 1.3, 1.0))


def test_unknown_or_bad_telemetry_gives_factor_one() -> None:
    cal = Calibration(f_slope=0.5, b_ratio=4.0, freq_offline_mhz=2000.0, n_off=1.0,
                      probe_bw_offline_gbs=30.0)
    for model in ("share", "paper"):
        m = ExpansionModel(model, cal, threads=2, cores=2)
        assert m.pis(ResourceSample()) == (1.0, 1.0)  # all NaN
        assert m.pis(ResourceSample(), probe_bw_gbs=NAN) == (1.0, 1.0)
        bad = _sample(n=-3.0, freq=-5.0, hit=1.7)  # garbage readings count as unknown
        assert m.pis(bad, probe_bw_gbs=-1.0) == (1.0, 1.0)
        assert m.pis(_sample(n=math.inf, freq=math.inf)) == (1.0, 1.0)
        ex = m.evaluate(ResourceSample())
        assert (ex.pi2_source, ex.competing, ex.share) == ("none", 1.0, 1.0)
    # a negative calibrated slope cannot make pi1 <= 0 or NaN
    neg = ExpansionModel("paper", Calibration(f_slope=-2.0), threads=1, cores=2)
    assert neg.pis(_sample(n=1.0)) == (1.0, 1.0)


def test_expansion_model_defaults_and_bad_config(monkeypatch: pytest.MonkeyPatch) -> None:
    cal = Calibration(n_off=2.0, freq_offline_mhz=1800.0, cache_hit_offline=0.7,
                      probe_bw_offline_gbs=25.0, threads=3)
    m = ExpansionModel(calibration=cal, cores=4)
    assert (m.model, m.threads, m.cores, m.pi2_mode) == ("share", 3, 4, "probe")
    assert m.reference == OfflineReference(2.0, 1800.0, 0.7, 25.0)
    assert ExpansionModel(cores=4).threads == 1  # calibration without threads: 1
    # cores 0: this process's affinity (3 CPUs here, of more on the machine), at least 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 3, 5}, raising=False)
    assert ExpansionModel().cores == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(), raising=False)
    assert ExpansionModel().cores == 1
    for kwargs, needle in (({"model": "linear"}, "linear"), ({"pi2_mode": "llc"}, "llc"),
                           ({"cores": -1}, "-1"), ({"threads": -2}, "-2"),
                           ({"threads": 1.5}, "1.5"), ({"calibration": {}}, "calibration")):
        with pytest.raises(ValueError, match=needle):
            ExpansionModel(**kwargs)
    with pytest.raises(ValueError, match="competing"):
        OfflineReference(competing=-1.0)
    with pytest.raises(ValueError, match="cache_hit_rate"):
        OfflineReference(cache_hit_rate=2.0)


def test_calibration_reference_fields_validated() -> None:
    c = Calibration()
    assert (c.n_off, c.threads) == (0.0, 0) and math.isnan(c.probe_bw_offline_gbs)
    assert math.isnan(Calibration(n_off=NAN).n_off)  # unknown is allowed
    for kwargs, needle in (({"n_off": -1.0}, "n_off"), ({"probe_bw_offline_gbs": 0.0},
                           "probe_bw"), ({"threads": -1}, "threads"),
                           ({"threads": 2.0}, "threads")):
        with pytest.raises(ValueError, match=needle):
            Calibration(**kwargs)


def _fb_profile(eta: list[float]) -> UnitProfile:
    """Two units, reforward 3 ms and 1 ms."""
    return UnitProfile(model="m", device="cpu", batch_size=1, input_shape=(3, 8, 8),
                       unit_names=["u0", "u1"], w_ms=np.array([1.0, 2.0]),
                       x_ms=np.full(2, 0.5), r_ms=np.array([3.0, 1.0]),
                       eta=np.asarray(eta, float), forward_ms=4.0)


def test_uniform_feedback_rescales_every_time_to_the_measured_forward() -> None:
    from tta_core.adashadow.predictor import feedback_pis, planning_times

    prof = _fb_profile([3.0, 0.25])
    w0, x0, r0 = runtime_times(prof, 1.5, 1.2)
    w, x, r = planning_times(prof, 1.5, 1.2, 8.0, "uniform")
    k = 8.0 / r0.sum()
    assert r.sum() == pytest.approx(8.0)
    np.testing.assert_allclose(w, w0 * k)
    np.testing.assert_allclose(x, x0 * k)
    assert feedback_pis(prof, 1.5, 1.2, 8.0, "uniform") == pytest.approx((1.5 * k, 1.2 * k))


def test_memory_feedback_solves_pi2_from_the_forward_and_slows_memory_bound_units_more() -> None:
    from tta_core.adashadow.predictor import feedback_pis, planning_times

    # unit 0 compute-bound (a = 3/4), unit 1 memory-bound (a = 1/5); r_off = 3, 1
    prof = _fb_profile([3.0, 0.25])
    pi1, pi2 = feedback_pis(prof, 1.0, 1.0, 4.6, "memory")
    # hand: comp = 3*3/4 + 1*1/5 = 2.45, mem = 3/4 + 4/5 = 1.55; pi2 = (4.6 - 2.45) / 1.55
    assert pi1 == 1.0 and pi2 == pytest.approx(2.15 / 1.55)
    w, x, r = planning_times(prof, 1.0, 1.0, 4.6, "memory")
    assert r.sum() == pytest.approx(4.6)  # the measured forward, exactly
    # the forward slowed 4.6 / 4 = 1.15x; the memory-bound unit slows more, the other less
    slow = r / prof.r_ms
    assert slow[1] > 1.15 > slow[0] > 1.0
    np.testing.assert_allclose(w / prof.w_ms, slow)
    np.testing.assert_allclose(x / prof.x_ms, slow)
    # telemetry's pi1 is kept: compute sharing it saw is not read as memory contention
    assert feedback_pis(prof, 2.0, 2.0, 9.2, "memory") == pytest.approx((2.0, 2.0 + 1.2 / 1.55))


def test_memory_feedback_falls_back_to_uniform_when_the_forward_is_faster() -> None:
    from tta_core.adashadow.predictor import feedback_pis

    prof = _fb_profile([3.0, 0.25])
    # telemetry says 2x, the forward ran only 1.5x: the load was overestimated
    assert feedback_pis(prof, 2.0, 2.0, 6.0, "memory") == pytest.approx((1.5, 1.5))
    assert feedback_pis(prof, 2.0, 2.0, 6.0, "memory") == \
        pytest.approx(feedback_pis(prof, 2.0, 2.0, 6.0, "uniform"))


def test_feedback_compares_with_a_forward_of_the_same_kind() -> None:
    """A forward that records the graph only from unit 1 on is compared with r_0 + g_1."""
    from tta_core.adashadow.predictor import feedback_pis, forward_reference

    prof = _fb_profile([1.0, 1.0])  # r = (3, 1); graph-recording forward g = (4, 2)
    prof.g_ms = np.array([4.0, 2.0])
    np.testing.assert_allclose(forward_reference(prof, 0), [4.0, 2.0])
    np.testing.assert_allclose(forward_reference(prof, 1), [3.0, 2.0])
    np.testing.assert_allclose(forward_reference(prof, 2), [3.0, 1.0])
    # the same 5 ms forward: idle for a forward with the graph from unit 1 on (3 + 2),
    # faster than idle for a full-graph one (4 + 2), slower for a no-graph one (3 + 1)
    assert feedback_pis(prof, 1.0, 1.0, 5.0, "uniform", grad_from=1) == pytest.approx((1, 1))
    assert feedback_pis(prof, 1.0, 1.0, 5.0, "uniform") == pytest.approx((5 / 6, 5 / 6))
    assert feedback_pis(prof, 1.0, 1.0, 5.0, "uniform", 2) == pytest.approx((1.25, 1.25))
    for bad in (-1, 3, True):
        with pytest.raises(ValueError, match="grad_from"):
            forward_reference(prof, bad)
    # profiles without g (older files, MAC estimates) use r, and g survives a round trip
    assert UnitProfile.from_dict({k: v for k, v in _fb_profile([1.0, 1.0]).to_dict().items()
                                  if k != "g_ms"}).g_ms.tolist() == [3.0, 1.0]
    assert UnitProfile.from_dict(prof.to_dict()).g_ms.tolist() == [4.0, 2.0]


def test_feedback_off_or_unmeasured_forward_keeps_the_telemetry_pis() -> None:
    from tta_core.adashadow.predictor import feedback_pis

    prof = _fb_profile([3.0, 0.25])
    assert feedback_pis(prof, 1.3, 1.1, 9.0, "off") == (1.3, 1.1)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert feedback_pis(prof, 1.3, 1.1, bad, "memory") == (1.3, 1.1)
    with pytest.raises(ValueError, match="feedback mode"):
        feedback_pis(prof, 1.0, 1.0, 4.0, "both")
    with pytest.raises(ValueError, match="pi1"):
        feedback_pis(prof, 0.0, 1.0, 4.0, "uniform")
    zero = _fb_profile([3.0, 0.25])
    zero.r_ms = zero.g_ms = np.zeros(2)
    with pytest.raises(ValueError, match="sum to > 0"):
        feedback_pis(zero, 1.0, 1.0, 4.0, "uniform")

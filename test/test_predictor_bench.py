"""`tta predictor-bench` (AdaShadow Table 9 on this machine) and its pure helpers.

The end-to-end test runs the real command on small_resnet at 32 px with real competing
processes (offline + dr2 only) and checks the output files, that the competitors are gone,
and that three busy processes both slow the backward down and raise the runtime pi1.
"""

from __future__ import annotations

import json

import numpy as np
import psutil
import pytest

from tta_core.adashadow import planner
from tta_core.adashadow.expansion import MODELS, ExpansionModel, OfflineReference
from tta_core.adashadow.predictor import Calibration, UnitProfile, feedback_pis, runtime_times
from tta_core.cli import main
from tta_core.eval.predictor_bench import BenchConfig, _Bench, _Trace, plan_backward_ms
from tta_core.telemetry import ResourceSample

RNG = np.random.default_rng(3)


def test_plan_backward_is_the_contract_cost_minus_forward_and_reforward() -> None:
    n = 9
    w, x, r = RNG.random(n), RNG.random(n), RNG.random(n)
    ss = np.array([0, 0, 2, 2, 2, 5, 5, 7, 8])
    prob = planner.PlanProblem(w=w, x=x, r=r, stage_start=ss, importance=np.ones(n),
                               forward_ms=3.0, sigma=1.0)
    for _ in range(20):
        upd = RNG.random(n) < 0.4
        if not upd.any():
            assert plan_backward_ms(w, x, upd) == 0.0
            continue
        d = int(np.flatnonzero(upd)[0])
        want = planner.plan_cost(prob, upd) - 3.0 - r[ss[d]:].sum()
        assert plan_backward_ms(w, x, upd) == pytest.approx(want)
    with pytest.raises(ValueError, match="update shape"):
        plan_backward_ms(w, x, np.ones(n - 1, dtype=bool))


def test_observe_evaluates_the_product_expansion_models() -> None:
    """The bench's pi1/pi2 are tta_core.adashadow.expansion's, for both models."""
    cal = Calibration(f_slope=0.5)
    ref = OfflineReference(competing=0.0, probe_bw_gbs=30.0)
    models = {m: ExpansionModel(m, cal, ref, threads=1, cores=2) for m in MODELS}
    n = 4
    profile = UnitProfile(model="m", device="d", batch_size=1, input_shape=(3, 8, 8),
                          unit_names=[f"u{i}" for i in range(n)], w_ms=RNG.random(n),
                          x_ms=RNG.random(n), r_ms=RNG.random(n), eta=RNG.random(n) * 3,
                          forward_ms=1.0)
    update = np.array([False, True, False, True])
    sample = ResourceSample(competing_processes=3.0, cpu_percent=50.0)

    class Sampler:
        def sample(self) -> ResourceSample:
            return sample

    class Probe:
        def measure(self) -> float:
            return 10.0

    bench = _Bench(BenchConfig(threads=1, cores=2), profile, update, meas=None,
                   sampler=Sampler(), probe=Probe(), models=models)
    trace = _Trace()
    pis = bench.observe(trace)
    # share: s(3) = 4/2 = 2 -> pi1 2, pi2 2 * 30/10; paper: 1 + 0.5 * 3, pi2 30/10
    assert (trace.pi1, trace.pi2, trace.share, trace.pi2_mem) == ([2.0], [6.0], [2.0], [3.0])
    assert (trace.pi1_alt, trace.pi2_alt, trace.pi2_src) == ([2.5], [3.0], ["probe"])
    for model, preds in (("share", trace.runtime_pred), ("paper", trace.alt_pred)):
        w, x, _ = runtime_times(profile, *models[model].pis(sample, 10.0))
        assert preds == [pytest.approx(plan_backward_ms(w, x, update))]
    # forward feedback: the share-model times rescaled so that their forward = the measured
    w, x, r = runtime_times(profile, 2.0, 6.0)
    k = 7.0 / r.sum()
    assert pis == (2.0, 6.0)
    assert bench.feedback_prediction(pis, 7.0, "uniform") == pytest.approx(
        plan_backward_ms(w, x, update) * k)
    # memory feedback: pi1 kept, pi2 solved so that the forward is the measured one
    fast, slow = r.sum(), 2 * r.sum()
    assert bench.feedback_prediction(pis, fast, "memory") == pytest.approx(
        plan_backward_ms(w, x, update))  # the forward telemetry predicted: nothing to solve
    p1, p2 = feedback_pis(profile, *pis, slow, "memory")
    assert p1 == 2.0 and runtime_times(profile, p1, p2)[2].sum() == pytest.approx(slow)
    w2, x2, _ = runtime_times(profile, p1, p2)
    assert bench.feedback_prediction(pis, slow, "memory") == pytest.approx(
        plan_backward_ms(w2, x2, update))


def test_backward_feedback_column_learns_only_from_earlier_batches() -> None:
    """The machine runs the plan 1.5x slower than the uniform-feedback prediction: the
    backward-feedback prediction starts there (factor 1) and converges on the measured
    time, each batch predicted with the factor learnt before it was measured."""
    from tta_core.eval.predictor_bench import _measure

    n = 4
    profile = UnitProfile(model="m", device="d", batch_size=1, input_shape=(3, 8, 8),
                          unit_names=[f"u{i}" for i in range(n)], w_ms=RNG.random(n),
                          x_ms=RNG.random(n), r_ms=RNG.random(n), eta=np.ones(n),
                          forward_ms=1.0)
    update = np.array([False, True, True, True])
    uniform = plan_backward_ms(profile.w_ms, profile.x_ms, update)  # forward as profiled

    class Sampler:
        def sample(self) -> ResourceSample:
            return ResourceSample()  # nothing known: pi1 = pi2 = 1

    class Meas:
        def once(self) -> tuple[float, float]:
            return float(profile.r_ms.sum()), 1.5 * uniform

    cfg = BenchConfig(threads=1, cores=2, batches=25, warmup=0, pi2_mode="perf")
    models = {m: ExpansionModel(m, Calibration(), OfflineReference(), threads=1, cores=2)
              for m in MODELS}
    bench = _Bench(cfg, profile, update, meas=Meas(), sampler=Sampler(), probe=None,
                   models=models)
    trace, truncated, _ = _measure(bench, lambda _n: None)
    assert not truncated and len(trace.measured) == 25
    assert trace.fb_uniform_pred == [pytest.approx(uniform)] * 25
    assert trace.bwd_factor[0] == 1.0 and trace.bwd_fb_pred[0] == pytest.approx(uniform)
    assert np.all(np.diff(trace.bwd_factor) > 0)  # learning, one batch behind
    assert trace.bwd_fb_pred[-1] == pytest.approx(1.5 * uniform, rel=0.01)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="dr9"):
        BenchConfig(conditions=("offline", "dr9"))
    with pytest.raises(ValueError, match="pi2_mode"):
        BenchConfig(pi2_mode="guess")
    with pytest.raises(ValueError, match="sigma"):
        BenchConfig(sigma=0.0)


def _cal(tmp_path):
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"schema": "tta.calibration/1", "calibration": {
        "f_slope": 0.4, "f_intercept": 0.0, "b_ratio": 8.0, "freq_offline_mhz": None,
        "cache_hit_offline": None}}))
    return cal


def test_cli_offline_and_dr2_small_resnet(tmp_path) -> None:
    cal = _cal(tmp_path)
    out = tmp_path / "bench"
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    rc = main(["predictor-bench", "--arch", "small_resnet", "--image-size", "32",
               "--batch-size", "32", "--batches", "30", "--conditions", "offline,dr2",
               "--pi2", "perf", "--calibration", str(cal), "--max-condition-s", "8",
               "--out", str(out), "--no-progress"])
    assert rc == 0
    assert {p.pid for p in me.children(recursive=True)} <= before  # competitors reaped
    res = json.loads((out / "results.json").read_text())
    assert res["schema"] == "tta.predictor_bench/1"
    assert (out / "table.md").read_text().count("| dr2 |") == 1
    assert (out / "errors.png").read_bytes()[:4] == b"\x89PNG"
    assert 0 < len(res["plan_units"]) < res["n_units"]
    # the offline reference of the expansion models (expansion.OfflineReference)
    assert set(res["offline"]) == {"competing", "freq_mhz", "cache_hit_rate", "probe_bw_gbs"}
    assert res["offline"]["probe_bw_gbs"] is None and res["offline_profile_s"] > 0  # --pi2 perf
    rows = {c["name"]: c for c in res["conditions"]}
    assert list(rows) == ["offline", "dr2"] and "dr1" in res["skipped"]
    for c in rows.values():
        assert c["batches"] == len(c["measured_all_ms"]) >= 10
        assert c["offline_pred_ms"] > 0 and c["measured_ms"] > 0
        assert c["err_runtime_pct"] == pytest.approx(
            abs(c["runtime_pred_ms"] - c["measured_ms"]) / c["measured_ms"] * 100)
        assert c["err_feedback_pct"] == pytest.approx(
            abs(c["feedback_pred_ms"] - c["measured_ms"]) / c["measured_ms"] * 100)
        assert c["err_feedback_per_batch_pct"] >= 0
        assert c["err_backward_fb_pct"] == pytest.approx(
            abs(c["backward_fb_pred_ms"] - c["measured_ms"]) / c["measured_ms"] * 100)
        assert 0.25 <= c["backward_factor"] <= 4.0  # BackwardFeedback's clip
        # no LLC counters and --pi2 perf: memory expansion 1, "share" scales it by s(n)
        assert c["pi2_mem"] == 1.0 and c["pi2_source"] == "none"
        assert c["pi2"] == pytest.approx(c["share"]) and c["pi2_alt"] == 1.0
    idle, busy = rows["offline"], rows["dr2"]
    assert busy["competing"] >= 3  # our three competitors were seen by psutil
    assert busy["measured_ms"] > 1.2 * idle["measured_ms"]
    assert busy["pi1"] > 1.0 and busy["pi1_alt"] > 1.0 and busy["share"] > 1.0
    assert busy["runtime_pred_ms"] > busy["offline_pred_ms"]
    assert busy["feedback_pred_ms"] > 1.2 * idle["feedback_pred_ms"]  # the forward slowed too


def test_cli_reuses_a_given_profile_and_rejects_a_mismatched_one(tmp_path, monkeypatch) -> None:
    from tta_core.adashadow import profiler
    from tta_core.model.norms import set_bn_mode
    from tta_core.model.units import decompose
    from tta_core.model.zoo import build_model

    model = build_model("small_resnet", 16)
    set_bn_mode(model, "batch")
    prof = profiler.profile_model(decompose(model, (3, 32, 32), "small_resnet"), batch=8,
                                  repeats=1)
    given = tmp_path / "given.json"
    prof.save(given)

    def no_profiling(*_a, **_k):
        raise AssertionError("the bench profiled although --profile was given")

    monkeypatch.setattr(profiler, "profile_model", no_profiling)
    args = ["predictor-bench", "--arch", "small_resnet", "--image-size", "32", "--batches", "5",
            "--conditions", "offline", "--pi2", "perf", "--calibration", str(_cal(tmp_path)),
            "--max-condition-s", "5", "--no-progress", "--profile", str(given)]
    out = tmp_path / "bench"
    assert main([*args, "--batch-size", "8", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["offline_profile_s"] < 0.5 and res["conditions"][0]["batches"] >= 1
    # the offline prediction is the given profile's cost of the plan
    again = UnitProfile.load(out / "profile.json")
    assert again.to_dict() == prof.to_dict()
    upd = np.array([n in res["plan_units"] for n in prof.unit_names])
    assert res["conditions"][0]["offline_pred_ms"] == pytest.approx(
        plan_backward_ms(prof.w_ms, prof.x_ms, upd))
    with pytest.raises(SystemExit, match=r"measured at batch 8.*runs batch 16"):
        main([*args, "--batch-size", "16", "--out", str(tmp_path / "bad")])
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read --profile"):
        main([*args[:-1], str(tmp_path / "junk.json"), "--batch-size", "8",
              "--out", str(tmp_path / "bad2")])

"""`tta predictor-bench` (AdaShadow Table 9 on this machine) and its pure helpers.

The end-to-end test runs the real command on small_resnet at 32 px with real competing
processes (offline + dr2 only) and checks the output files, that the competitors are gone,
and that three busy processes both slow the backward down and raise the runtime pi1.
"""

from __future__ import annotations

import json
import math

import numpy as np
import psutil
import pytest

from tta_core import planner
from tta_core.cli import main
from tta_core.predictor import Calibration, memory_expansion
from tta_core.predictor_bench import (
    BenchConfig,
    OfflineState,
    estimate_pi2,
    plan_backward_ms,
    relative_pi1,
    round_robin_share,
    share_pis,
)

RNG = np.random.default_rng(3)


def _off(competing: float = 0.0, bw: float = 30.0, freq: float = math.nan) -> OfflineState:
    return OfflineState(competing=competing, freq_mhz=freq, cache_hit_rate=math.nan,
                        probe_bw_gbs=bw, profile_s=1.0)


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


def test_round_robin_share_and_share_pis_by_hand() -> None:
    # 1 thread on 2 cores: one competitor fits on the free core, three share 2 cores by 4
    assert round_robin_share(1, _off(0), threads=1, cores=2) == 1.0
    assert round_robin_share(3, _off(0), threads=1, cores=2) == 2.0
    assert round_robin_share(5, _off(1), threads=1, cores=2) == 3.0
    # T = C: the line 1 + n / C through the origin, relative to n_off
    assert round_robin_share(2, _off(0), threads=2, cores=2) == 2.0
    assert round_robin_share(4, _off(2), threads=2, cores=2) == 1.5
    # sharing scales compute and memory; DVFS 2000 -> 1000 MHz doubles compute only
    assert share_pis(1000.0, 3, 1.25, _off(0, freq=2000.0), 1, 2) == (4.0, 2.5)
    assert share_pis(math.nan, 3, 1.25, _off(0, freq=2000.0), 1, 2) == (2.0, 2.5)
    with pytest.raises(ValueError, match="cores"):
        round_robin_share(1, _off(), threads=1, cores=0)


def test_relative_pi1_and_pi2_by_hand() -> None:
    cal = Calibration(f_slope=0.5, b_ratio=4.0, cache_hit_offline=0.9)
    assert relative_pi1(math.nan, 2, _off(0), cal) == pytest.approx(2.0)
    assert relative_pi1(math.nan, 3, _off(1), cal) == pytest.approx(2.5 / 1.5)
    assert relative_pi1(math.nan, 1, _off(1), cal) == pytest.approx(1.0)
    pi2, src = estimate_pi2(0.6, 10.0, _off(bw=30.0), cal, "probe")  # phi known wins
    assert (pi2, src) == (pytest.approx(memory_expansion(0.6, cal)), "perf")
    assert pi2 == pytest.approx((0.6 + 0.4 * 4) / (0.9 + 0.1 * 4))
    assert estimate_pi2(math.nan, 10.0, _off(bw=30.0), cal, "probe") == (3.0, "probe")
    assert estimate_pi2(math.nan, 10.0, _off(bw=30.0), cal, "perf") == (1.0, "none")


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="dr9"):
        BenchConfig(conditions=("offline", "dr9"))
    with pytest.raises(ValueError, match="pi2_mode"):
        BenchConfig(pi2_mode="guess")
    with pytest.raises(ValueError, match="sigma"):
        BenchConfig(sigma=0.0)


def test_cli_offline_and_dr2_small_resnet(tmp_path) -> None:
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"schema": "tta.calibration/1", "calibration": {
        "f_slope": 0.4, "f_intercept": 0.0, "b_ratio": 8.0, "freq_offline_mhz": None,
        "cache_hit_offline": None}}))
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
    rows = {c["name"]: c for c in res["conditions"]}
    assert list(rows) == ["offline", "dr2"] and "dr1" in res["skipped"]
    for c in rows.values():
        assert c["batches"] == len(c["measured_all_ms"]) >= 10
        assert c["offline_pred_ms"] > 0 and c["measured_ms"] > 0
        assert c["err_runtime_pct"] == pytest.approx(
            abs(c["runtime_pred_ms"] - c["measured_ms"]) / c["measured_ms"] * 100)
        # no LLC counters and --pi2 perf: memory expansion 1, "share" scales it by s(n)
        assert c["pi2_mem"] == 1.0 and c["pi2_source"] == "none"
        assert c["pi2"] == pytest.approx(c["share"]) and c["pi2_alt"] == 1.0
    idle, busy = rows["offline"], rows["dr2"]
    assert busy["competing"] >= 3  # our three competitors were seen by psutil
    assert busy["measured_ms"] > 1.2 * idle["measured_ms"]
    assert busy["pi1"] > 1.0 and busy["pi1_alt"] > 1.0 and busy["share"] > 1.0
    assert busy["runtime_pred_ms"] > busy["offline_pred_ms"]

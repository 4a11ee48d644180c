"""Calibration: line fit by hand, busy-process lifecycle, and a quick real run via the CLI."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import psutil
import pytest

from tta_core.adashadow.calibration import (
    BusyProcesses,
    CalibrationConfig,
    CalibrationReport,
    fit_slowdown,
    load_calibration,
)
from tta_core.adashadow.predictor import Calibration
from tta_core.cli import main
from tta_core.telemetry import PerfSource


def test_fit_slowdown_by_hand() -> None:
    ks, slow = [0, 1, 2, 3], [1.0, 1.0, 1.5, 2.0]
    slope, icpt = fit_slowdown(ks, slow)
    assert (slope, icpt) == (pytest.approx(4 / 14), 0.0)  # sum(k*y)/sum(k^2), y = slow - 1
    slope, icpt = fit_slowdown(ks, slow, fit_intercept=True)
    assert slope == pytest.approx(1.75 / 5) and icpt == pytest.approx(0.375 - 1.5 * 0.35)
    with pytest.raises(ValueError):
        fit_slowdown([0], [1.0])
    with pytest.raises(ValueError):
        fit_slowdown([0, 2], [1.0, float("nan")])
    with pytest.raises(ValueError, match="ks"):
        CalibrationConfig(ks=(1, 2))


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_busy_processes_cleaned_up_on_interrupt() -> None:
    before = _children()
    with pytest.raises(KeyboardInterrupt):
        with BusyProcesses(2, "compute") as busy:
            pids = busy.pids
            assert len(pids) == 2 and set(pids) <= _children()
            # each one computes: CPU time grows (waited on, not slept: a busy machine
            # starts them late)
            procs = [psutil.Process(p) for p in pids]
            start = [sum(q.cpu_times()[:2]) for q in procs]

            def grown() -> bool:
                return all(sum(q.cpu_times()[:2]) - t0 >= 0.05
                           for q, t0 in zip(procs, start, strict=True))

            deadline = time.monotonic() + 30.0
            while not grown() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert grown()
            raise KeyboardInterrupt
    assert not set(pids) & _children() and _children() <= before
    with pytest.raises(ValueError, match="kind"):
        BusyProcesses(1, "io")


def test_busy_processes_bounded_in_time() -> None:
    busy = BusyProcesses(1, "memory", max_s=0.3, memory_bytes=1 << 20).__enter__()
    proc = busy.procs[0]
    proc.join(timeout=5.0)  # exits on its own at the deadline, nobody stops it
    assert not proc.is_alive() and proc.exitcode == 0
    busy.stop()


@pytest.mark.slow
def test_calibrate_quick_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real command end to end, on a fake workload (no wall clock: how much two busy
    processes slow a real matmul is `tta calibrate`'s measurement, not a test's): its time
    grows by 25 % per competing process alive while it runs, so the slowdown of k = 2 is
    exactly 1.5 only if calibrate really runs the workload among k live competitors."""
    from tta_core.adashadow import calibration

    before = _children()  # children of other tests, if any, are not competitors
    monkeypatch.setattr(calibration._Workload, "run",
                        lambda self: 40.0 * (1.0 + 0.25 * len(_children() - before)))

    class OthersOnTheMachine:  # psutil's view: 3 other processes, plus our live competitors
        def __init__(self, proc_interval_s: float) -> None:
            assert proc_interval_s > 0

        def read(self) -> dict:
            return {"competing_processes": 3 + len(_children() - before)}

    monkeypatch.setattr(calibration, "PsutilSource", OthersOnTheMachine)
    out = tmp_path / "calibration_test.json"
    assert main(["calibrate", "--quick", "--out", str(out), "--no-progress"]) == 0
    data = json.loads(out.read_text())
    m = data["measurements"]
    # the fake workload: 40 ms alone, 25 % more per live competitor; the k = 0 time taken
    # with none alive (the k = 2 ones reaped before the idle baseline is timed again)
    assert m["ks"] == [0, 2] and m["times_ms"] == pytest.approx([40.0, 60.0]), m
    assert m["slowdown"][1] == pytest.approx(1.5), m  # 2 live competitors while timed
    cal = load_calibration(out)
    assert isinstance(cal, Calibration)
    assert cal.f_slope > 0 and cal.f_intercept == 0.0
    assert cal.f_slope == pytest.approx((m["slowdown"][1] - 1) / 2)
    assert cal.b_ratio >= 1.0
    assert cal.b_ratio == pytest.approx(m["bw_cache_gbs"] / m["bw_dram_gbs"])
    perf = PerfSource(pid=os.getpid())
    perf_ok = perf.describe().available
    perf.close()
    if perf_ok:  # clipped to [0, 1]: what can fail is no references counted (NaN)
        assert math.isfinite(cal.cache_hit_offline)
    else:
        assert math.isnan(cal.cache_hit_offline)
    # the expansion model's offline reference: what else ran during the idle (k = 0) run,
    # the others on the machine and none of calibrate's own competitors
    assert cal.n_off == 3.0
    assert cal.probe_bw_offline_gbs > 0 and cal.threads == 1  # --quick: 1 thread
    assert data["calibration"]["threads"] == 1
    assert not _children()  # every competing process was reaped


def test_old_calibration_json_without_reference_keys_loads(tmp_path: Path) -> None:
    old = {"f_slope": 0.4, "f_intercept": 0.0, "b_ratio": 8.0, "freq_offline_mhz": None,
           "cache_hit_offline": 0.9}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"schema": "tta.calibration/1", "calibration": old}))
    cal = load_calibration(path)
    assert (cal.f_slope, cal.b_ratio, cal.cache_hit_offline) == (0.4, 8.0, 0.9)
    assert (cal.n_off, cal.threads) == (0.0, 0) and math.isnan(cal.probe_bw_offline_gbs)
    assert math.isnan(cal.freq_offline_mhz)
    new = {**old, "n_off": None, "probe_bw_offline_gbs": 21.5, "threads": 2}
    path.write_text(json.dumps({"schema": "tta.calibration/1", "calibration": new}))
    cal = load_calibration(path)
    assert math.isnan(cal.n_off) and cal.probe_bw_offline_gbs == 21.5 and cal.threads == 2
    assert isinstance(cal.threads, int)
    # a report round-trips through its own JSON (NaN <-> null)
    report = CalibrationReport(calibration=cal, ks=[0, 1], times_ms=[1.0, 1.5],
                               slowdown=[1.0, 1.5], threads=2, bw_cache_gbs=80.0,
                               bw_dram_gbs=10.0, cache_buffer_bytes=1, dram_buffer_bytes=2,
                               temp_offline_c=math.nan)
    report.save(path)
    again = load_calibration(path)
    assert again.threads == 2 and again.probe_bw_offline_gbs == 21.5 and math.isnan(again.n_off)

"""Plausibility bounds (tta_ros.nodes.plausibility) on every numeric field of every message
the nodes take in, as tables of boundary values: the bounds themselves and values just
inside are accepted, values just outside (the next float32), NaN and infinities refused
with one line naming the field and the value (NaN accepted where the message marks
unknown values NaN). The bounds are non-default, so the node parameters are what is
checked. In test/ros: the module and the messages need rclpy/tta_msgs. Over real DDS:
test_ros_plausibility.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("rclpy")
from hypothesis import given
from hypothesis import strategies as st
from tta_msgs.msg import (
    AdaptationStatus,
    FleetReport,
    LayerImportance,
    LayerPlan,
    ResourceTelemetry,
)

from tta_ros.nodes import plausibility as pl
from tta_ros.nodes.plausibility import Bounds, Implausible, Refusals

B = Bounds(max_forward_ms=500.0, max_budget_ms=2000.0, max_batch_size=64, max_speed_mps=60.0)


def _plan() -> LayerPlan:
    return LayerPlan(sigma=0.3, budget_ms=5.0, predicted_unit_ms=[1.0, 2.0],
                     importance=[0.5, 0.1])


def _importance() -> LayerImportance:
    return LayerImportance(importance=[0.5, 0.1], forward_ms=5.0, batch_size=4)


def _fleet() -> FleetReport:
    return FleetReport(sizes=[0.5, 1.0], forward_ms=[3.0, 5.0], accuracy=[0.8, 0.9],
                       hz=30.0, deadline_ms=100.0, batch_size=8, keep=0.0, served=math.nan)


# (message factory, check, field, index in a list field or None, low, high, low open,
#  NaN accepted, integer field)
TABLE = [
    (_plan, pl.check_plan, "sigma", None, 0.0, 1.0, False, False, False),
    (_plan, pl.check_plan, "budget_ms", None, 0.0, 2000.0, False, False, False),
    (_plan, pl.check_plan, "predicted_total_ms", None, 0.0, 2000.0, False, False, False),
    (_plan, pl.check_plan, "solve_ms", None, 0.0, 2000.0, False, False, False),
    (_plan, pl.check_plan, "predicted_unit_ms", 1, 0.0, 500.0, False, False, False),
    (_plan, pl.check_plan, "importance", 0, 0.0, pl.MAX_IMPORTANCE, False, False, False),
    (_importance, pl.check_importance, "forward_ms", None, 0.0, 500.0, True, False, False),
    (_importance, pl.check_importance, "batch_size", None, 1, 64, False, False, True),
    (_importance, pl.check_importance, "importance", 1, 0.0, pl.MAX_IMPORTANCE, False,
     False, False),
    (AdaptationStatus, pl.check_status, "forward_ms", None, 0.0, 500.0, False, False, False),
    *[(AdaptationStatus, pl.check_status, f, None, 0.0, 2000.0, False, True, False)
      for f in ("plan_ms", "backward_ms", "reforward_ms", "total_ms", "predicted_total_ms",
                "budget_ms", "deadline_ms")],
    (AdaptationStatus, pl.check_status, "loss", None, -pl.MAX_IMPORTANCE, pl.MAX_IMPORTANCE,
     False, True, False),
    (AdaptationStatus, pl.check_status, "peak_memory_mb", None, 0.0, pl.MAX_MB, False, True,
     False),
    *[(ResourceTelemetry, pl.check_telemetry, f, None, lo, hi, False, True, False)
      for f, (lo, hi) in pl.TELEMETRY_RANGES.items() if f != "mem_used_mb"],
    (_fleet, pl.check_fleet_report, "sizes", 0, 0.0, 1.0, True, False, False),
    (_fleet, pl.check_fleet_report, "forward_ms", 1, 0.0, 500.0, True, False, False),
    (_fleet, pl.check_fleet_report, "accuracy", 0, 0.0, 1.0, False, False, False),
    (_fleet, pl.check_fleet_report, "hz", None, 0.0, 1000.0, True, False, False),
    (_fleet, pl.check_fleet_report, "deadline_ms", None, 0.0, 2000.0, True, False, False),
    (_fleet, pl.check_fleet_report, "batch_size", None, 1, 64, False, False, True),
    (_fleet, pl.check_fleet_report, "keep", None, 0.0, 1.0, False, False, False),
    (_fleet, pl.check_fleet_report, "served", None, 0.0, 1.0, True, True, False),
]
IDS = [f"{row[1].__name__}-{row[2]}" for row in TABLE]


def _with(make, name: str, index: int | None, value: float):
    msg = make()
    if name == "mem_total_mb":  # used memory must stay <= total: keep used at 0
        msg.mem_used_mb = 0.0
    if index is None:
        setattr(msg, name, value)
    else:
        values = list(getattr(msg, name))
        values[index] = value
        setattr(msg, name, values)
    return msg


def _f32_next(v: float, toward: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(toward)))


def _refused(check, msg, name: str, index: int | None) -> str:
    with pytest.raises(Implausible) as info:
        check(msg, B)
    text = str(info.value)
    field = name if index is None else f"{name}[{index}]"
    assert text.startswith(f"{field} = ") and "\n" not in text and len(text) < 120, text
    return text


@pytest.mark.parametrize("row", TABLE, ids=IDS)
def test_boundaries_accepted_just_outside_refused(row) -> None:
    make, check, name, index, low, high, low_open, nan_ok, is_int = row
    check(make(), B)  # the base message is valid
    if is_int:
        inside, outside = [low, high, (low + high) // 2], [low - 1, high + 1, 4_000_000_000]
        outside = [v for v in outside if v >= 0]  # uint32 fields
    else:
        inside = [high, _f32_next(high, low), _f32_next(low, high), (low + high) / 2]
        outside = [_f32_next(high, math.inf), math.inf, -math.inf, 3e38]
        if not low_open:
            inside.append(low)
        outside.append(low if low_open else _f32_next(low, -math.inf))
        (inside if nan_ok else outside).append(math.nan)
    for v in inside:
        check(_with(make, name, index, v), B)
    for v in outside:
        text = _refused(check, _with(make, name, index, v), name, index)
        assert f" = {pl.shown(v)} outside" in text, text


@pytest.mark.parametrize(("make", "check", "field", "value", "text"), [
    (_plan, pl.check_plan, "sigma", 3e38, r"3e\+38"),
    (_importance, pl.check_importance, "forward_ms", 99999.0, "99999.0"),
    (_importance, pl.check_importance, "batch_size", 4_000_000_000, "4000000000"),
])
def test_issue_fuzz_cases_refused_at_default_bounds(make, check, field, value, text) -> None:
    msg = make()
    setattr(msg, field, value)
    with pytest.raises(Implausible, match=f"^{field} = {text} outside"):
        check(msg, Bounds())


def test_telemetry_used_memory_above_total_refused() -> None:
    ok = ResourceTelemetry(mem_used_mb=100.0, mem_total_mb=100.0)
    pl.check_telemetry(ok)
    pl.check_telemetry(ResourceTelemetry(mem_used_mb=100.0, mem_total_mb=math.nan))
    with pytest.raises(Implausible, match=r"mem_used_mb = 101\.0 above mem_total_mb = 100\.0"):
        pl.check_telemetry(ResourceTelemetry(mem_used_mb=101.0, mem_total_mb=100.0))
    with pytest.raises(Implausible, match=r"cpu_percent_per_core\[1\] = 101.0"):
        pl.check_telemetry(ResourceTelemetry(cpu_percent_per_core=[3.0, 101.0]))


def test_fleet_report_lengths_must_match() -> None:
    msg = _fleet()
    msg.accuracy = [0.5]
    with pytest.raises(Implausible, match="accuracy has 1 values for 2 sizes"):
        pl.check_fleet_report(msg, B)


def test_speed_bounds() -> None:
    for v in (0.0, 60.0, math.nan):
        pl.check_speed(v, B)
    for v in (-0.1, 60.01, math.inf, 3e38):
        with pytest.raises(Implausible, match=r"^speed = "):
            pl.check_speed(v, B)


@given(st.floats(width=32, allow_nan=True, allow_infinity=True))
def test_sigma_accepted_exactly_in_zero_one(sigma: float) -> None:
    """[0, 1]: 0 is a zero budget (serve only), a plan the scheduler sends when nothing of
    the deadline is left."""
    msg = _plan()
    msg.sigma = sigma
    try:
        pl.check_plan(msg, B)
    except Implausible:
        assert not 0 <= sigma <= 1
    else:
        assert 0 <= sigma <= 1


@pytest.mark.parametrize(("sigma", "budget_ms"), [(0.0, 0.0), (0.0, 5.0), (0.3, 0.0)])
def test_a_zero_budget_serves_only(sigma: float, budget_ms: float) -> None:
    """A zero budget (sigma or budget_ms 0) is a valid plan when it updates nothing; one
    that selects a unit contradicts itself and is refused, naming both numbers."""
    msg = _plan()
    msg.sigma, msg.budget_ms, msg.update = sigma, budget_ms, [False, False]
    pl.check_plan(msg, B)
    msg.update = [False, True]
    with pytest.raises(Implausible, match=r"^a zero budget \(sigma = .*budget_ms = .*\) "
                       r"updates 1 unit\(s\)"):
        pl.check_plan(msg, B)


def test_bounds_from_node_parameters() -> None:
    values = {s.name: s.default for s in pl.PLAUSIBILITY_PARAMS}
    assert Bounds.from_params(values) == Bounds()
    names = {s.name: (s.low, s.high) for s in pl.PLAUSIBILITY_PARAMS}
    assert names == {"max_forward_ms": (1.0, 1e5), "max_budget_ms": (1.0, 1e6),
                     "max_batch_size": (1, 65536), "max_speed_mps": (1.0, 1000.0)}
    spec = next(s for s in pl.PLAUSIBILITY_PARAMS if s.name == "max_forward_ms")
    assert spec.check(0.5) == "max_forward_ms=0.5 outside [1, 100000]"


def test_refusals_count_each_and_log_once_per_period() -> None:
    lines: list[str] = []
    now = [100.0]
    r = Refusals(lines.append, period_s=5.0, clock=lambda: now[0])
    msg = _plan()
    msg.sigma = 3e38
    for _ in range(3):
        assert not r.admit("LayerPlan", pl.check_plan, msg, B)
    assert r.admit("LayerPlan", pl.check_plan, _plan(), B)
    r.refuse("odometry", "speed = 1e3 outside [0, 60]")
    assert r.counts == {"LayerPlan": 3, "odometry": 1} and r.total == 4
    assert lines == ["LayerPlan refused (1 so far): sigma = 3e+38 outside [0, 1]",
                     "odometry refused (1 so far): speed = 1e3 outside [0, 60]"]
    now[0] += 5.0
    r.admit("LayerPlan", pl.check_plan, msg, B)
    assert lines[-1] == "LayerPlan refused (4 so far): sigma = 3e+38 outside [0, 1]"
    assert r.values() == {"messages_refused": 5,
                          "last_message_refused": "LayerPlan: sigma = 3e+38 outside [0, 1]"}


def test_rate_limit_allows_the_first_few_of_each_second() -> None:
    from tta_ros.nodes.plausibility import RateLimit

    now = [10.0]
    limit = RateLimit(per_s=3, clock=lambda: now[0])
    assert [limit.allow() for _ in range(5)] == [True, True, True, False, False]
    now[0] += 0.5
    assert not limit.allow()
    now[0] += 0.5
    assert [limit.allow() for _ in range(4)] == [True, True, True, False]

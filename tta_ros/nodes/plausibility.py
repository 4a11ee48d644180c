"""Plausibility bounds on the numbers of every message the nodes take in.

A message that is well-formed (right model, right lengths: tta_ros.convert.check_plan and
check_importance) can still carry numbers no vehicle produces: sigma = 3e38, a 99999 ms
forward, a batch of 4e9 frames. Planning with them gives absurd budgets, so each message
is checked here before it is used: every numeric field finite (NaN only where the message
marks unknown values NaN) and inside a range, the ranges for times and batch sizes from
node parameters (PLAUSIBILITY_PARAMS, validated like any other). A refused message raises
Implausible naming the field and its value; `Refusals` counts them per message kind and
logs one line per kind at most every `period_s`, so a flood of forged messages costs the
checks only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tta_ros.convert import MAX_FORWARD_MS
from tta_ros.ros_params import ParamSpec

#: importance is a KL divergence in nats: real values stay far below this
MAX_IMPORTANCE = 1e6
#: pi1/pi2: how many times slower than offline the device runs now (0 or NaN: unknown)
MAX_EXPANSION = 100.0
#: megabytes (memory, GPU memory): 1 PB
MAX_MB = 1e9

PLAUSIBILITY_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("max_forward_ms", 10_000.0, "plausibility: a forward time (LayerImportance, "
              "AdaptationStatus, FleetReport) above this, ms, refuses the message", 1.0,
              MAX_FORWARD_MS, read_only=True),
    ParamSpec("max_budget_ms", 10_000.0, "plausibility: a budget, deadline or update time "
              "(LayerPlan, AdaptationStatus, FleetReport) above this, ms, refuses the "
              "message", 1.0, 1e6, read_only=True),
    ParamSpec("max_batch_size", 256, "plausibility: a batch size (LayerImportance, "
              "FleetReport) above this refuses the message (perception's batch_size limit)",
              1, 65536, read_only=True),
    ParamSpec("max_speed_mps", 150.0, "plausibility: an odometry speed above this, m/s, is "
              "ignored", 1.0, 1000.0, read_only=True),
)


class Implausible(ValueError):
    """A message field outside its plausible range (the message says which, and its value)."""


@dataclass(frozen=True)
class Bounds:
    """The configurable limits (PLAUSIBILITY_PARAMS)."""

    max_forward_ms: float = 10_000.0
    max_budget_ms: float = 10_000.0
    max_batch_size: int = 256
    max_speed_mps: float = 150.0

    @classmethod
    def from_params(cls, values: Mapping[str, Any]) -> Bounds:
        """From a node's parameter values (the PLAUSIBILITY_PARAMS names)."""
        return cls(float(values["max_forward_ms"]), float(values["max_budget_ms"]),
                   int(values["max_batch_size"]), float(values["max_speed_mps"]))


def shown(value: float) -> str:
    """`value` as short as it reads back: a float32 message field as float32 (3e+38, not
    3.0000000054977558e+38), an integer field as an integer."""
    if isinstance(value, int | np.integer):
        return str(int(value))
    v = float(value)
    f32 = np.float32(v) if abs(v) <= 3.4028234663852886e38 or not math.isfinite(v) else None
    return str(f32) if f32 is not None and float(f32) == v else repr(v)


def in_range(name: str, value: float, low: float, high: float, *, low_open: bool = False,
             nan_ok: bool = False) -> None:
    """Implausible unless `value` is finite and in [low, high] ((low, high] when
    `low_open`); NaN passes when `nan_ok` (fields that mark unknown values NaN)."""
    v = float(value)
    if nan_ok and math.isnan(v):
        return
    above_low = v > low if low_open else v >= low
    if not (math.isfinite(v) and above_low and v <= high):
        lo = "(" if low_open else "["
        raise Implausible(f"{name} = {shown(value)} outside {lo}{low:g}, {high:g}]")


def all_in_range(name: str, values: Iterable[float], low: float, high: float, *,
                 low_open: bool = False, nan_ok: bool = False) -> None:
    """in_range for each element, the error naming its index."""
    for i, v in enumerate(values):
        in_range(f"{name}[{i}]", v, low, high, low_open=low_open, nan_ok=nan_ok)


def check_plan(msg: Any, b: Bounds) -> None:
    """LayerPlan: sigma in [0, 1] (the budget's share of a full update; the scheduler caps
    a deadline's share at 1), budget, predicted and solve times in [0, max_budget_ms], unit
    times in [0, max_forward_ms], importance in [0, MAX_IMPORTANCE]. A zero budget (sigma
    = 0 or budget_ms = 0: nothing of the deadline is left once the forward's time and its
    scatter margin are kept) is a valid plan that serves without update, so it selects no
    unit."""
    in_range("sigma", msg.sigma, 0.0, 1.0)
    for name in ("budget_ms", "predicted_total_ms", "solve_ms"):
        in_range(name, getattr(msg, name), 0.0, b.max_budget_ms)
    if (msg.sigma == 0.0 or msg.budget_ms == 0.0) and any(msg.update):
        raise Implausible(f"a zero budget (sigma = {shown(msg.sigma)}, budget_ms = "
                          f"{shown(msg.budget_ms)}) updates {sum(map(bool, msg.update))} "
                          "unit(s): a zero-budget plan serves only")
    all_in_range("predicted_unit_ms", msg.predicted_unit_ms, 0.0, b.max_forward_ms)
    all_in_range("importance", msg.importance, 0.0, MAX_IMPORTANCE)


def check_importance(msg: Any, b: Bounds) -> None:
    """LayerImportance: forward_ms in (0, max_forward_ms], batch_size in [1,
    max_batch_size], importance in [0, MAX_IMPORTANCE]."""
    in_range("forward_ms", msg.forward_ms, 0.0, b.max_forward_ms, low_open=True)
    in_range("batch_size", msg.batch_size, 1, b.max_batch_size)
    all_in_range("importance", msg.importance, 0.0, MAX_IMPORTANCE)


def check_status(msg: Any, b: Bounds) -> None:
    """AdaptationStatus: forward_ms in [0, max_forward_ms]; the other times, the budget,
    the deadline (NaN in sigma*T mode) and the predicted total in [0, max_budget_ms]; loss
    and entropy finite or NaN (a diverged batch), peak memory in [0, MAX_MB] or NaN."""
    in_range("forward_ms", msg.forward_ms, 0.0, b.max_forward_ms)
    for name in ("plan_ms", "backward_ms", "reforward_ms", "total_ms", "predicted_total_ms",
                 "budget_ms", "deadline_ms"):  # deadline_ms: NaN from a tta_msgs without it
        in_range(name, getattr(msg, name, math.nan), 0.0, b.max_budget_ms, nan_ok=True)
    for name in ("loss", "mean_entropy"):
        in_range(name, getattr(msg, name), -MAX_IMPORTANCE, MAX_IMPORTANCE, nan_ok=True)
    in_range("peak_memory_mb", msg.peak_memory_mb, 0.0, MAX_MB, nan_ok=True)


#: ResourceTelemetry float fields -> (low, high); every one may be NaN (unknown)
TELEMETRY_RANGES: dict[str, tuple[float, float]] = {
    "cpu_percent": (0.0, 100.0), "gpu_percent": (0.0, 100.0),
    "cpu_temp_c": (-273.15, 500.0), "gpu_temp_c": (-273.15, 500.0),
    "cpu_freq_mhz": (0.0, 1e6), "cpu_freq_max_mhz": (0.0, 1e6),
    "gpu_freq_mhz": (0.0, 1e6), "gpu_freq_max_mhz": (0.0, 1e6),
    "cache_hit_rate": (0.0, 1.0), "mem_used_mb": (0.0, MAX_MB), "mem_total_mb": (0.0, MAX_MB),
    "gpu_mem_used_mb": (0.0, MAX_MB), "power_w": (0.0, 1e6),
    "compute_expansion": (0.0, MAX_EXPANSION), "memory_expansion": (0.0, MAX_EXPANSION),
}


def check_telemetry(msg: Any, _b: Bounds | None = None) -> None:
    """ResourceTelemetry: each float field NaN or in TELEMETRY_RANGES, per-core loads in
    [0, 100], used memory not above the total."""
    for name, (low, high) in TELEMETRY_RANGES.items():
        in_range(name, getattr(msg, name), low, high, nan_ok=True)
    all_in_range("cpu_percent_per_core", msg.cpu_percent_per_core, 0.0, 100.0, nan_ok=True)
    if msg.mem_used_mb > msg.mem_total_mb:  # False when either is NaN
        raise Implausible(f"mem_used_mb = {shown(msg.mem_used_mb)} above mem_total_mb = "
                          f"{shown(msg.mem_total_mb)}")


def check_fleet_report(msg: Any, b: Bounds) -> None:
    """FleetReport: one forward time and accuracy per size, sizes and keep in (0, 1] (keep
    0: the method's choice), served in (0, 1] or NaN, forward times in (0,
    max_forward_ms], accuracy in [0, 1], hz in (0, 1000], deadline in (0, max_budget_ms],
    batch_size in [1, max_batch_size]; retrain_ms (in (0, 1 h] or NaN), accuracy_before
    and accuracy_after ([0, 1] or NaN) empty (an older sender) or one per size."""
    n = len(msg.sizes)
    for name in ("forward_ms", "accuracy"):
        if len(getattr(msg, name)) != n:
            raise Implausible(f"{name} has {len(getattr(msg, name))} values for {n} sizes")
    all_in_range("sizes", msg.sizes, 0.0, 1.0, low_open=True)
    all_in_range("forward_ms", msg.forward_ms, 0.0, b.max_forward_ms, low_open=True)
    all_in_range("accuracy", msg.accuracy, 0.0, 1.0)
    in_range("hz", msg.hz, 0.0, 1000.0, low_open=True)
    in_range("deadline_ms", msg.deadline_ms, 0.0, b.max_budget_ms, low_open=True)
    in_range("batch_size", msg.batch_size, 1, b.max_batch_size)
    in_range("keep", msg.keep, 0.0, 1.0)
    in_range("served", msg.served, 0.0, 1.0, low_open=True, nan_ok=True)
    for name in ("retrain_ms", "accuracy_before", "accuracy_after"):
        if len(getattr(msg, name)) not in (0, n):
            raise Implausible(f"{name} has {len(getattr(msg, name))} values for {n} sizes")
    all_in_range("retrain_ms", msg.retrain_ms, 0.0, 3.6e6, low_open=True, nan_ok=True)
    all_in_range("accuracy_before", msg.accuracy_before, 0.0, 1.0, nan_ok=True)
    all_in_range("accuracy_after", msg.accuracy_after, 0.0, 1.0, nan_ok=True)


def check_speed(speed_mps: float, b: Bounds) -> None:
    """An odometry planar speed: NaN (unknown, ignored) or in [0, max_speed_mps]."""
    in_range("speed", speed_mps, 0.0, b.max_speed_mps, nan_ok=True)


@dataclass
class RateLimit:
    """At most `per_s` events a second (fixed one-second windows): what a flood of bad
    input may publish, the first few of each second."""

    per_s: int = 5
    clock: Callable[[], float] = time.monotonic
    _window: float = -math.inf
    _used: int = 0

    def allow(self) -> bool:
        now = self.clock()
        if now - self._window >= 1.0:
            self._window, self._used = now, 0
        self._used += 1
        return self._used <= self.per_s


@dataclass
class Refusals:
    """Messages refused per kind; one log line per kind at most every `period_s`."""

    log: Callable[[str], None]
    period_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    counts: dict[str, int] = field(default_factory=dict)
    last: str = ""
    _logged: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def refuse(self, kind: str, reason: object) -> None:
        """Count one refused `kind` message and log why unless logged recently."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.last = f"{kind}: {reason}"
        now = self.clock()
        if now - self._logged.get(kind, -math.inf) >= self.period_s:
            self._logged[kind] = now
            self.log(f"{kind} refused ({self.counts[kind]} so far): {reason}")

    def admit(self, kind: str, check: Callable[[Any, Bounds], None], msg: Any,
              bounds: Bounds) -> bool:
        """True when `check(msg, bounds)` passes; else the refusal is counted, False."""
        try:
            check(msg, bounds)
        except Implausible as exc:
            self.refuse(kind, exc)
            return False
        return True

    def values(self) -> dict[str, str | int]:
        """For a diagnostics status: the total and the last reason."""
        return {"messages_refused": self.total, "last_message_refused": self.last}

"""Deadline budgets: what one batch may cost in total, in ms.

AdaShadow's paper budget is relative: sigma * T, a share of the batch's full-update time.
A vehicle needs an absolute one. `batch_deadline_ms` gives it per batch for each mode:

- "sigma": no absolute deadline (NaN): the planner budgets sigma * T (paper; default);
- "fixed": `deadline_ms` per batch, or per frame (`deadline_per: frame`: a batch of b
  frames then has b * deadline_ms);
- "camera": frames arrive at `camera_hz`; a batch of b frames has b / camera_hz. This is
  the throughput reading of a deadline: the batch must be done before the next b frames
  have all arrived, so the pipeline keeps up with the camera (its queue does not grow and
  no frame is dropped); a frame's latency is then at most its wait for the batch to fill
  plus one batch time. It is "fixed" per frame with deadline_ms = 1000 / camera_hz;
- "speed": a batch is one decision; the vehicle may move at most
  `distance_per_decision_m` while it is made: distance / speed, clamped to
  [min_deadline_ms, max_deadline_ms]. Standing still (|speed| <= STILL_MPS) gives the
  maximum; an unknown speed (no fresh odometry) the minimum (the safe side).

The planner then budgets the whole batch against the deadline: forward, plan phase,
update (with its fixed cost) and reforward, so the room for updates is the deadline minus
the measured forward and the fixed costs (planning.PlanningService). Pure arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tta_core.runtime.fixed_costs import FixedCosts
from tta_core.runtime.options import option

__all__ = ["DEADLINE_MODES", "DEADLINE_PER", "STILL_MPS", "DeadlineConfig",
           "apply_settings", "batch_deadline_ms", "check_settings", "describe", "late_text"]

DEADLINE_MODES = ("sigma", "fixed", "camera", "speed")
DEADLINE_PER = ("batch", "frame")
STILL_MPS = 0.01  # at or below this speed (m/s) the vehicle counts as standing still
MAX_DEADLINE_MS = 3.6e6  # one hour: anything longer is a typo, not a deadline


@dataclass
class DeadlineConfig:
    """How a batch's deadline is set (module docstring); PlanningConfig extends it."""

    deadline_mode: str = option(
        "sigma", "what a batch's budget is: sigma = sigma*T (paper), fixed = deadline_ms, "
        "camera = the batch's frames at camera_hz, speed = distance_per_decision_m at the "
        "vehicle's speed; a deadline covers the whole batch (forward, plan, update, "
        "reforward)", choices=DEADLINE_MODES)
    deadline_ms: float = option(100.0, "fixed deadline [ms] per batch or per frame "
                                "(deadline_per)", low=0.0, high=MAX_DEADLINE_MS)
    deadline_per: str = option("batch", "fixed deadline: per batch, or per frame (a batch "
                               "of b frames then has b * deadline_ms)", choices=DEADLINE_PER)
    camera_hz: float = option(30.0, "camera deadline: frame rate of the stream; a batch of b "
                              "frames must be done within b / camera_hz", low=0.0,
                              high=MAX_DEADLINE_MS)
    distance_per_decision_m: float = option(1.0, "speed deadline: metres the vehicle may "
                                            "travel while a batch is processed", low=0.0,
                                            high=MAX_DEADLINE_MS)
    min_deadline_ms: float = option(20.0, "speed deadline: lower clamp [ms], also the "
                                    "deadline while the speed is unknown", low=0.0,
                                    high=MAX_DEADLINE_MS)
    max_deadline_ms: float = option(1000.0, "speed deadline: upper clamp [ms], the deadline "
                                    "when standing still", low=0.0, high=MAX_DEADLINE_MS)

    @property
    def has_deadline(self) -> bool:
        """True when batches have an absolute deadline (every mode but "sigma")."""
        return self.deadline_mode != "sigma"

    def validate(self) -> None:
        """Raise ValueError naming the first bad value."""
        if self.deadline_mode not in DEADLINE_MODES:
            raise ValueError(f"deadline_mode {self.deadline_mode!r} not in {DEADLINE_MODES}")
        if self.deadline_per not in DEADLINE_PER:
            raise ValueError(f"deadline_per {self.deadline_per!r} not in {DEADLINE_PER}")
        for name in ("deadline_ms", "camera_hz", "distance_per_decision_m",
                     "min_deadline_ms", "max_deadline_ms"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, int | float)
                    or not math.isfinite(value) or not 0 < value <= MAX_DEADLINE_MS):
                raise ValueError(f"{name}={value!r} must be a number in (0, "
                                 f"{MAX_DEADLINE_MS:g}]")
        if self.min_deadline_ms > self.max_deadline_ms:
            raise ValueError(f"min_deadline_ms={self.min_deadline_ms!r} is above "
                             f"max_deadline_ms={self.max_deadline_ms!r}")


def check_settings(cfg: DeadlineConfig, settings: dict[str, object]) -> None:
    """ValueError naming an unknown or bad deadline setting (DeadlineConfig field names) of
    `settings` applied to `cfg` (a config extending DeadlineConfig); `cfg` is unchanged."""
    known = {f.name for f in dataclasses.fields(DeadlineConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown deadline setting(s) {unknown}; known: {sorted(known)}")
    trial = DeadlineConfig(**{k: getattr(cfg, k) for k in known})
    for key, value in settings.items():
        setattr(trial, key, value)
    trial.validate()


def apply_settings(cfg: DeadlineConfig, settings: dict[str, object]) -> None:
    """Set deadline `settings` on `cfg` after `check_settings` (a bad one changes nothing):
    a method's set_deadline at run time."""
    check_settings(cfg, settings)
    for key, value in settings.items():
        setattr(cfg, key, value)


def speed_deadline_ms(cfg: DeadlineConfig, speed_mps: float | None) -> float:
    """distance / |speed| in ms, clamped; max when still, min when the speed is unknown."""
    lo, hi = float(cfg.min_deadline_ms), float(cfg.max_deadline_ms)
    if speed_mps is None or not math.isfinite(speed_mps):
        return lo
    speed = abs(float(speed_mps))
    if speed <= STILL_MPS:
        return hi
    return min(max(1000.0 * float(cfg.distance_per_decision_m) / speed, lo), hi)


def batch_deadline_ms(cfg: DeadlineConfig, batch_size: int,
                      speed_mps: float | None = None) -> float:
    """The deadline of a batch of `batch_size` frames in ms (NaN in "sigma" mode);
    `speed_mps`: the vehicle's speed for "speed" mode (None: unknown)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    mode = cfg.deadline_mode
    if mode == "sigma":
        return math.nan
    if mode == "fixed":
        per_frame = cfg.deadline_per == "frame"
        return float(cfg.deadline_ms) * (batch_size if per_frame else 1)
    if mode == "camera":
        return batch_size * 1000.0 / float(cfg.camera_hz)
    if mode == "speed":
        return speed_deadline_ms(cfg, speed_mps)
    raise ValueError(f"deadline_mode {mode!r} not in {DEADLINE_MODES}")


def describe(cfg: DeadlineConfig, speed_mps: float | None = None) -> str:
    """One line naming the mode and what sets the deadline, for messages."""
    mode = cfg.deadline_mode
    if mode == "fixed":
        return f"fixed {cfg.deadline_ms:g} ms per {cfg.deadline_per}"
    if mode == "camera":
        return f"camera {cfg.camera_hz:g} Hz ({1000.0 / cfg.camera_hz:.3g} ms per frame)"
    if mode == "speed":
        what = "unknown speed" if speed_mps is None or not math.isfinite(speed_mps) \
            else f"{abs(speed_mps):.3g} m/s"
        return (f"speed: {cfg.distance_per_decision_m:g} m per batch at {what}, clamped to "
                f"[{cfg.min_deadline_ms:g}, {cfg.max_deadline_ms:g}] ms")
    return "sigma*T"


def late_text(forward_ms: float, plan_phase_ms: float, deadline_ms: float, what: str) -> str:
    """Why a batch is served without update: its forward alone, or with the plan phase,
    already reaches the deadline (`what` describes the deadline)."""
    where = f"the deadline {deadline_ms:.3g} ms ({what})"
    if forward_ms > deadline_ms:
        return f"the forward alone ({forward_ms:.3g} ms) misses {where}: served without update"
    return (f"the forward ({forward_ms:.3g} ms) and the plan phase ({plan_phase_ms:.3g} ms) "
            f"leave no time within {where}: served without update")


class DeadlineBudget:
    """A batch's deadline for whoever plans against one (AdaShadow's PlanningService,
    ElasticDNN's ServingPlan, as their base class): from the config's deadline_* fields,
    the vehicle's speed and how late the batch starts, less the learnt margin of `fixed`."""

    config: DeadlineConfig
    fixed: FixedCosts
    _speed: float | None = None  # vehicle speed, m/s ("speed" deadlines); None: unknown
    _late_ms: float = 0.0  # how late the next batch starts (set_lateness)

    def set_speed(self, speed_mps: float | None) -> None:
        """The vehicle's speed for "speed" deadlines; None or NaN: unknown (the shortest
        deadline, min_deadline_ms, applies)."""
        if speed_mps is not None and not math.isnan(speed_mps) and math.isinf(speed_mps):
            raise ValueError(f"speed {speed_mps!r} m/s is not finite")
        self._speed = None if speed_mps is None or math.isnan(speed_mps) else float(speed_mps)

    def set_lateness(self, late_ms: float) -> None:
        """How late the next batches start against their deadline, ms: the time since the
        newest of their frames arrived (a backlog behind a slow batch). A deadline counts
        from that arrival, so this much of it is already spent: the planner plans into the
        rest (none left: served without update), and the backlog is caught up instead of
        carried along. Stays until set again; 0 (the default) in sigma*T mode or on time."""
        if not (math.isfinite(late_ms) and late_ms >= 0):
            raise ValueError(f"lateness must be a finite number >= 0 ms, got {late_ms!r}")
        self._late_ms = float(late_ms)

    @property
    def late_ms(self) -> float:
        """How late the next batch starts (set_lateness; 0: on time)."""
        return self._late_ms

    @property
    def speed_mps(self) -> float | None:
        """The speed the next "speed" deadline is made from (None: unknown)."""
        return self._speed

    def deadline_ms(self, batch_size: int = 1) -> float:
        """What is left of the deadline of a batch of `batch_size` frames: its deadline
        less the lateness (set_lateness), >= 0 (NaN in sigma*T mode)."""
        deadline = batch_deadline_ms(self.config, batch_size, self._speed)
        return deadline if math.isnan(deadline) else max(deadline - self._late_ms, 0.0)

    def describe_deadline(self) -> str:
        """The deadline mode in words (deadline.describe)."""
        return describe(self.config, self._speed)
    def budget_ms(self, batch_size: int = 1) -> tuple[float, float]:
        """(deadline, margin) of a batch: what the planner may plan into is deadline -
        margin (FixedCosts.margin_ms, at most the deadline); (NaN, 0) in sigma*T mode."""
        deadline = self.deadline_ms(batch_size)
        return deadline, (0.0 if math.isnan(deadline) else min(self.fixed.margin_ms, deadline))

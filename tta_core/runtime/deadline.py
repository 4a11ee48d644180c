"""Deadline budgets: what one batch may cost in total, in ms (issue #18).

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

__all__ = ["DEADLINE_MODES", "DEADLINE_PER", "STILL_MPS", "DeadlineConfig",
           "apply_settings", "batch_deadline_ms", "check_settings", "describe", "late_text"]

DEADLINE_MODES = ("sigma", "fixed", "camera", "speed")
DEADLINE_PER = ("batch", "frame")
STILL_MPS = 0.01  # at or below this speed (m/s) the vehicle counts as standing still
MAX_DEADLINE_MS = 3.6e6  # one hour: anything longer is a typo, not a deadline


@dataclass
class DeadlineConfig:
    """How a batch's deadline is set (module docstring); PlanningConfig extends it."""

    deadline_mode: str = "sigma"
    deadline_ms: float = 100.0  # "fixed": per batch or per frame (deadline_per)
    deadline_per: str = "batch"
    camera_hz: float = 30.0  # "camera": frame rate of the stream
    distance_per_decision_m: float = 1.0  # "speed": metres travelled per batch at most
    min_deadline_ms: float = 20.0  # "speed": clamps (and the deadline at unknown speed)
    max_deadline_ms: float = 1000.0  # "speed": the deadline when standing still

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

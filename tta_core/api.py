"""The method interface every consumer (bench, replay, ROS nodes) programs against.

- `StepResult` / `PhaseTimes`: what one batch produced, with typed optional parts
  (`PlanningInfo` for methods that plan layer updates) instead of an untyped dict;
- `PhaseClock`: the one clock every method times its phases with (it synchronises CUDA
  before reading the time, so GPU timings are fair between methods; `event` /
  `elapsed_ms` time a phase in device time with CUDA events, without a synchronisation);
- capability protocols: what a method *can* do beyond `step`/`reset` (take an external
  plan, change sigma or the deadline at run time, serve at a chosen size, take live
  telemetry, report a domain).
  Consumers test
  `isinstance(method, Protocol)`; nothing sniffs attributes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

NAN = math.nan


@dataclass
class Plan:
    """A layer-update plan: the units to update (bool per unit, forward order), the first
    of them, and its predicted cost (AdaShadow's planner, or the ROS `layer_plan` topic)."""

    update: np.ndarray
    first_updated: int
    objective: float
    predicted_total_ms: float
    budget_ms: float  # sigma * T, or the problem's absolute budget (deadline)
    full_ms: float
    solve_ms: float


@dataclass
class PhaseTimes:
    """Wall time of each phase, ms. In parallel mode backward_ms is written when the
    background update ends (see `TTAMethodLike.finish`). `post_ms`: output-side work
    after the forward (LAME's assignment solve)."""

    forward_ms: float = 0.0
    plan_ms: float = 0.0
    backward_ms: float = 0.0
    reforward_ms: float = 0.0
    total_ms: float = 0.0
    post_ms: float = 0.0


@dataclass
class PlanningInfo:
    """What a planning method knows about its batch's plan (AdaShadow)."""

    predicted_backward_ms: float = NAN  # by the per-unit model; NaN for an external plan
    backward_factor: float = 1.0  # closed-loop correction of predicted backward times
    plan_phase_ms: float = 0.0  # learnt plan phase the budget leaves room for
    overhead_ms: float = 0.0  # learnt fixed cost of any update
    no_room: str = ""  # why no trainable unit fits the budget ("" when one does)
    deadline_ms: float = NAN  # the batch's deadline (NaN: the sigma*T budget)
    forward_misses: bool = False  # the forward alone took longer than the deadline
    skipped: bool = False  # no plan could fit: no assessor (importance zeros), no planner


@dataclass
class StepResult:
    """Everything one batch produced; logits are detached.

    `stats` holds method-specific figures for reports and tests (EATA's sample counts,
    SAR's recoveries, ...): consumers that must act on something get a typed field."""

    logits: Tensor
    times: PhaseTimes
    loss: float = NAN
    mean_entropy: float = NAN
    adapted: bool = False
    units_updated: int = 0
    plan: Plan | None = None
    importance: np.ndarray = field(default_factory=lambda: np.zeros(0))
    predicted_total_ms: float = NAN
    budget_ms: float = NAN
    planning: PlanningInfo | None = None
    domain: str = ""  # recognised domain id, "" if the method has none
    stats: dict[str, float | int | bool] = field(default_factory=dict)


def mean_entropy(logits: Tensor) -> float:
    """Mean Shannon entropy (nats) of the softmax predictions."""
    logp = torch.log_softmax(logits.detach().float(), dim=1)
    return float(-(logp.exp() * logp).sum(1).mean())


class PhaseClock:
    """perf_counter in ms, after torch.cuda.synchronize when the work runs on a GPU, so
    a phase's time includes its kernels (asynchronous launches would favour whoever does
    not wait). `mark()` returns the ms since the previous mark.

    Device time without a synchronisation per phase (CUDA): `event()` records a timing
    event on the current stream now and returns it; `elapsed_ms(start, end)` is the
    device time between two such events, read once both are done (it waits for `end`
    only). Record the boundaries while the work is queued, read them when the batch's
    result is read anyway:

        start = clock.event(); forward(x); mid = clock.event(); backward()
        end = clock.event(); ...; fwd_ms = PhaseClock.elapsed_ms(start, mid)

    On the CPU `event()` is None and `elapsed_ms` NaN: time the CPU with `mark()`."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._last = self.now()

    @classmethod
    def for_tensor(cls, x: Tensor) -> PhaseClock:
        """A clock for work on x's device."""
        return cls(x.device)

    def now(self) -> float:
        """Seconds (perf_counter), after the GPU's queued work finished."""
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self) -> float:
        """Milliseconds since the previous mark (or construction)."""
        t = self.now()
        ms, self._last = (t - self._last) * 1e3, t
        return ms

    def event(self) -> torch.cuda.Event | None:
        """On CUDA: a `torch.cuda.Event(enable_timing=True)` recorded on the clock's
        device's current stream (no synchronisation); None on the CPU."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    @staticmethod
    def elapsed_ms(start: torch.cuda.Event | None, end: torch.cuda.Event | None) -> float:
        """Device milliseconds from `start` to `end` (two `event()`s, start first),
        after `end` completed; NaN when either is None (the CPU)."""
        if start is None or end is None:
            return NAN
        end.synchronize()
        return float(start.elapsed_time(end))


# ---------------------------------------------------------------- capabilities
@runtime_checkable
class TTAMethodLike(Protocol):
    """What every method offers (tta_core.runtime.method.TTAMethod): adapt on a batch and
    predict, change the learning rate, wait for work in flight (`finish`: in parallel mode
    the last step's update runs in the background and fills that step's backward_ms),
    restore the source."""

    name: str

    def step(self, x: Tensor) -> StepResult: ...

    def set_lr(self, lr: float) -> None: ...

    def finish(self) -> None: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class TakesPlan(Protocol):
    """Accepts an external layer-update plan (the ROS `layer_plan` topic) for a batch;
    `trainable` (bool per unit) says which units a plan may update."""

    unit_names: Sequence[str]
    trainable: np.ndarray

    def step(self, x: Tensor, plan: Plan | None = None) -> StepResult: ...


@runtime_checkable
class RuntimeTunable(Protocol):
    """Sigma can change between batches (the learning rate always can: `set_lr`)."""

    def set_sigma(self, sigma: float) -> None: ...


@runtime_checkable
class DeadlineTunable(Protocol):
    """Plans against a batch deadline (tta_core.runtime.deadline): its settings change
    between batches (`set_deadline(deadline_mode=..., camera_hz=...)`, ValueError naming a
    bad one), "speed" deadlines follow the vehicle's speed (`set_speed`, None: unknown),
    and a batch that starts late (a backlog) has that much less of its deadline left
    (`set_lateness`, ms since its newest frame arrived)."""

    def set_deadline(self, **settings: object) -> None: ...

    def set_speed(self, speed_mps: float | None) -> None: ...

    def set_lateness(self, late_ms: float) -> None: ...


@runtime_checkable
class Resizable(Protocol):
    """Serves a surrogate of its model at a chosen size, the share of filters kept per gated
    conv (ElasticDNN, tta_core.elasticdnn.method): `sizes` lists the sizes it can serve
    (largest first, 1.0 the full master), `set_size(keep)` pins one of them from the next
    batch on (a fleet scheduler's choice; ValueError naming a size it lacks), None returns
    to the method's own choice (the largest whose predicted forward fits the deadline);
    `size_forward_ms` predicts a batch's forward per size (ms, at the last batch size)."""

    def sizes(self) -> tuple[float, ...]: ...

    def set_size(self, keep: float | None) -> None: ...

    def size_forward_ms(self) -> dict[float, float]: ...


@runtime_checkable
class Retrains(Protocol):
    """A Resizable method that retrains each size on the current domain (ElasticDNN's
    retraining windows, §III-C2): `size_retrain_ms` predicts T per size, the time of its
    retraining (a fixed number of update steps) with the whole processor, from measured
    update steps of that size (ms, NaN: none measured); `domain_representation` is the
    current domain's representation (mean penultimate feature vector of recent batches,
    None before any), what Eq. 5 measures domain distances on."""

    def size_retrain_ms(self) -> dict[float, float]: ...

    def domain_representation(self) -> np.ndarray | None: ...


@runtime_checkable
class TakesTelemetry(Protocol):
    """Plans with live expansion factors (pi1, pi2) from telemetry; `clear_expansion`
    returns to offline factors when telemetry goes stale."""

    def set_expansion(self, pi1: float, pi2: float) -> None: ...

    def clear_expansion(self) -> None: ...


@runtime_checkable
class ReportsDomain(Protocol):
    """Recognises the ongoing domain (StepResult.domain is filled)."""

    def current_domain(self) -> str: ...


@runtime_checkable
class WarmsUp(Protocol):
    """Learns its run-time costs on a sample batch before the first real one (a camera
    node at start, a benchmark before its stream), leaving its weights and state as they
    were: `warm_up(x)`."""

    def warm_up(self, x: Tensor) -> None: ...

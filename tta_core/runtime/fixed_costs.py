"""What a batch costs outside the per-unit cost model, learnt from the batches so far.

The planner's per-unit times (w, x, r) scale with MACs or with a profile of the units'
kernels. Two costs do not: the plan phase itself (the loss, the assessor, the predictor
and the DP run after the forward and before any backward, on every batch) and a fixed
part of every update (launching autograd, the loss head's gradient, the optimizer step,
the reforward's call overhead). On a small net they are a large share of a σ·T budget,
and a planner blind to them overruns it on every batch. Both are measured on every
batch, so the planner can leave room for them: `plan_ms` is added to T_f, `overhead_ms`
is the planner's fixed cost of any non-empty plan (planner.PlanProblem.overhead_ms).

Each is an EMA (weight `alpha` for the newest batch) started at the first measurement
after `warmup` ignored ones (the first update of a run pays one-time allocations). A
sample is clipped to [-scale, scale] with `scale` the batch's forward time, and once
OUTLIER_MIN samples are in the window of recent ones to at most OUTLIER_FACTOR times their
median (or the median plus OUTLIER_SLACK forwards, the larger): one preempted batch moves an
estimate by little and cannot empty the plans for long, while a cost that really rose
fills the window and is learnt within about half its length. The update's cost is only measured when
an update runs, so an estimate that leaves no plan within the budget could never be
corrected (one slow start would freeze adaptation for good): every batch without an
update forgets a share `forget` of it, so a plan is tried again after a while (about
25 batches from 0.8 to 0.5 ms at the default 0.02) and measured afresh; likewise the plan
phase on every batch that skipped it (`skip_plan`: a deadline the forward and plan phase
already reach). With a deadline, plans also leave room for the scatter of the whole
batch's time around its prediction (`margin_ms`: EMA mean + 2.33 EMA standard deviations
of measured minus predicted, at least its 99th percentile over the last 128 batches; a
plan that fills the deadline to 99 % otherwise misses it on every other batch from timing
noise alone; its first `warmup` samples ignored and later ones bounded like the others),
forgotten like the plan phase while batches skip it or do not update (a margin learnt
from a cold start left no plan, and without a plan it was never measured again).
Forgetting moves the update's cost and the plan phase toward the least of their last
FLOOR_WINDOW measurements (warm-up excluded), not toward 0: a retry predicted below every
cost yet seen missed its deadline by construction (small net, 1000 Hz: every retry was ~1
ms over, 4 of 375 batches); the floor itself ages FLOOR_AGING times slower, so a slow
first measurement cannot freeze adaptation for good. alpha = 0 turns both off (the planner
then sees exactly the per-unit model, and plans no longer depend on how fast a run is).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

#: deadline margin: mean + MARGIN_Z standard deviations of the batch time's residual
#: (about its 99th percentile were it normal), once MARGIN_WARMUP batches were measured,
#: and at least the MARGIN_QUANTILE of the last MARGIN_WINDOW residuals: timing noise is
#: heavy-tailed (a preempted thread), and the EMA's short memory forgets a tail that
#: comes every few dozen batches
MARGIN_Z = 2.33
MARGIN_WARMUP = 3
MARGIN_QUANTILE = 0.99
MARGIN_WINDOW = 128
#: forgetting stops at the least of the last FLOOR_WINDOW measurements, which age
#: FLOOR_AGING times slower than the estimate
FLOOR_WINDOW = 16
FLOOR_AGING = 8
#: a sample counts at most OUTLIER_FACTOR times the median of the recent window (or the
#: median plus OUTLIER_SLACK times the batch's forward, the larger) once it holds
#: OUTLIER_MIN samples
OUTLIER_MIN = 3
OUTLIER_FACTOR = 2.0
OUTLIER_SLACK = 0.25
#: retries of an update that keeps missing its deadline slow down at most 2**6-fold
MAX_BACKOFF = 6


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


@dataclass
class FixedCosts:
    """EMAs of the plan phase and of the update's fixed cost, ms; alpha = 0: off."""

    alpha: float = 0.2
    plan_ms: float = 0.0  # forward end -> plan ready, every batch
    adapt_ms: float = 0.0  # measured minus predicted backward + reforward, per update
    warmup: int = 1  # first measurements of each kind that are ignored
    forget: float = 0.02  # share of the update's cost forgotten per batch without update
    plan_updates: int = 0  # measurements seen, warm-up included
    adapt_updates: int = 0
    # the whole batch's time minus its prediction (deadline modes): EMA mean and variance
    total_mean_ms: float = 0.0
    total_var_ms2: float = 0.0
    total_updates: int = 0
    recent_ms: deque = field(default_factory=lambda: deque(maxlen=MARGIN_WINDOW))
    backoff: int = 0  # updates in a row that missed their deadline (at most MAX_BACKOFF)
    # the last measurements after warm-up: where forgetting stops (_toward_floor)
    adapt_seen: deque = field(default_factory=lambda: deque(maxlen=FLOOR_WINDOW))
    plan_seen: deque = field(default_factory=lambda: deque(maxlen=FLOOR_WINDOW))

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha) and 0.0 <= self.alpha <= 1.0):
            raise ValueError(f"fixed-cost feedback alpha must be in [0, 1], got {self.alpha!r}")
        if self.warmup < 0:
            raise ValueError(f"fixed-cost feedback warmup must be >= 0, got {self.warmup!r}")
        if not (math.isfinite(self.forget) and 0.0 <= self.forget <= 1.0):
            raise ValueError(f"fixed-cost feedback forget must be in [0, 1], got "
                             f"{self.forget!r}")

    @property
    def on(self) -> bool:
        return self.alpha > 0.0

    @property
    def overhead_ms(self) -> float:
        """Fixed cost of a non-empty plan for the planner (never below 0; 0 when off)."""
        return max(self.adapt_ms, 0.0) if self.on else 0.0

    @property
    def plan_phase_ms(self) -> float:
        """Expected plan-phase time of the next batch (0 when off)."""
        return self.plan_ms if self.on else 0.0

    def _ema(self, old: float, sample: float, n: int) -> float:
        if n < self.warmup:
            return old
        return sample if n == self.warmup else (1.0 - self.alpha) * old + self.alpha * sample

    def update_plan(self, measured_ms: float, scale_ms: float) -> None:
        """Fold in one batch's plan phase."""
        if not self.on or not _finite(measured_ms, scale_ms) or measured_ms < 0:
            return
        sample = min(measured_ms, abs(scale_ms))
        self.plan_ms = self._ema(self.plan_ms, _robust(sample, self.plan_seen, scale_ms),
                                 self.plan_updates)
        if self.plan_updates >= self.warmup:
            self.plan_seen.append(sample)
        self.plan_updates += 1

    def update_adapt(self, predicted_ms: float, measured_ms: float, scale_ms: float) -> None:
        """Fold in one update: `predicted_ms` is the per-unit model's backward + reforward
        of the plan (without this overhead), `measured_ms` what they took."""
        if not self.on or not _finite(predicted_ms, measured_ms, scale_ms) or measured_ms <= 0:
            return
        bound = abs(scale_ms)
        sample = min(bound, max(-bound, measured_ms - predicted_ms))
        self.adapt_ms = self._ema(self.adapt_ms, _robust(sample, self.adapt_seen, bound),
                                  self.adapt_updates)
        if self.adapt_updates >= self.warmup:
            self.adapt_seen.append(sample)
        self.adapt_updates += 1

    @property
    def margin_ms(self) -> float:
        """Room a deadline plan leaves for the batch time's scatter around its prediction:
        mean + MARGIN_Z standard deviations of the residual, at least its MARGIN_QUANTILE
        over the last MARGIN_WINDOW batches (>= 0; 0 when off or before MARGIN_WARMUP
        batches were measured after the `warmup` ones)."""
        if not self.on or self.total_updates < self.warmup + MARGIN_WARMUP:
            return 0.0
        ema = self.total_mean_ms + MARGIN_Z * math.sqrt(self.total_var_ms2)
        return max(ema, _quantile(self.recent_ms, MARGIN_QUANTILE), 0.0)

    def update_total(self, predicted_ms: float, measured_ms: float, scale_ms: float) -> None:
        """Fold in one batch's whole time against what its plan predicted (clipped to the
        batch's forward time `scale_ms`, like the other samples)."""
        if not self.on or not _finite(predicted_ms, measured_ms, scale_ms) or measured_ms <= 0:
            return
        bound = abs(scale_ms)
        n, self.total_updates = self.total_updates, self.total_updates + 1
        if n < self.warmup:  # the first updates pay one-time allocations
            return
        raw = min(bound, max(-bound, measured_ms - predicted_ms))
        residual = _robust(raw, self.recent_ms, bound)  # one preempted batch: bounded
        self.recent_ms.append(raw)
        diff = residual - self.total_mean_ms
        if n == self.warmup:
            self.total_mean_ms, self.total_var_ms2 = residual, 0.0
        else:
            self.total_mean_ms += self.alpha * diff
            self.total_var_ms2 = (1.0 - self.alpha) * (self.total_var_ms2
                                                       + self.alpha * diff * diff)

    @property
    def forget_now(self) -> float:
        """The share forgotten per batch now: `forget`, halved for every update in a row
        that missed its deadline (a retry every ~35 batches that always misses would
        alone cost ~3 % of the batches at a rate where only the forward fits)."""
        return self.forget / (1 << self.backoff)

    def update_deadline(self, adapted: bool, total_ms: float, deadline_ms: float) -> None:
        """A batch took `total_ms` against `deadline_ms` (NaN: sigma*T, ignored); only a
        batch that `adapted` counts: an update in time ends the backoff, a late one
        lengthens it."""
        if adapted and math.isfinite(deadline_ms) and math.isfinite(total_ms):
            late = total_ms > deadline_ms
            self.backoff = min(self.backoff + 1, MAX_BACKOFF) if late else 0

    def _toward_floor(self, value: float, seen: deque) -> tuple[float, deque]:
        """`value` less a share forget_now of its excess over the least of `seen` (0
        when empty), and `seen` aged FLOOR_AGING times slower."""
        keep = 1.0 - self.forget_now
        floor = min(min(seen, default=0.0), value)
        aged = 1.0 - self.forget_now / FLOOR_AGING
        return floor + (value - floor) * keep, deque((v * aged for v in seen),
                                                     maxlen=FLOOR_WINDOW)

    def idle(self) -> None:
        """A batch ran without an update: forget a share of the update's cost (down to
        the least cost measured lately, which ages slower)."""
        if self.on:
            self.adapt_ms, self.adapt_seen = self._toward_floor(self.adapt_ms,
                                                                self.adapt_seen)
            self._forget_margin()

    def _forget_margin(self) -> None:
        """Forget a share forget_now of the deadline margin: a margin that leaves no plan
        is only measured again once a plan runs."""
        keep = 1.0 - self.forget_now
        self.total_mean_ms *= keep
        self.total_var_ms2 *= keep ** 2
        self.recent_ms = deque((v * keep for v in self.recent_ms), maxlen=MARGIN_WINDOW)

    def skip_plan(self) -> None:
        """A batch skipped its plan phase (no plan could fit): forget a share of the plan
        phase (down to the least measured lately) and of the deadline margin, so that
        estimates that leave no time for any plan are tried again."""
        if self.on:
            self.plan_ms, self.plan_seen = self._toward_floor(self.plan_ms, self.plan_seen)
            self._forget_margin()

    def reset(self) -> None:
        """Forget what was learnt (a new machine or model)."""
        self.plan_ms = self.adapt_ms = self.total_mean_ms = self.total_var_ms2 = 0.0
        self.plan_updates = self.adapt_updates = self.total_updates = self.backoff = 0
        for seen in (self.recent_ms, self.adapt_seen, self.plan_seen):
            seen.clear()


def _robust(sample: float, seen: deque, scale_ms: float) -> float:
    """`sample` bounded by the recent window `seen` (module docstring: OUTLIER_*); the
    window itself keeps the raw samples, so a lasting change still gets through."""
    if len(seen) < OUTLIER_MIN:
        return sample
    med = statistics.median(seen)
    return min(sample, max(OUTLIER_FACTOR * med, med + OUTLIER_SLACK * abs(scale_ms)))


def _quantile(values: deque, q: float) -> float:
    """The q-quantile of `values` (linear interpolation; -inf when empty)."""
    if not values:
        return -math.inf
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])

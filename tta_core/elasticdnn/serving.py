"""Load-adaptive serving (ElasticDNN): which surrogate size serves a batch.

A gated master can be served whole or as a dense surrogate keeping a share `keep` of the
filters of every gated conv (tta_core.elasticdnn.surrogate). Under a batch deadline
(tta_core.runtime.deadline, the same modes as AdaShadow's) the method serves the largest
size whose predicted forward fits what is left of the deadline after the learnt margin,
the full master (1.0) whenever it fits, and goes back up as soon as a larger size fits
again; with time left it also adapts the served surrogate (and re-derives the surrogates).

Predicted forward time of size k at batch n: `base(k, n) * load`. `base` is measured once
per batch size at warm-up (each size run on an input of the real shape, the fastest of a
few runs: at build for batch sizes up to the method's warmup_batch, else at the first batch
of that size);
`load` is one EMA over served batches of measured / base (weight alpha_up 0.5 when a batch
was slower than predicted, alpha 0.2 when faster), shared by all sizes, so a
machine that slows down (another process, thermal limits) slows every size's prediction
and one that recovers lets the larger sizes back in, although they were not served in
between. The update's cost is learnt per size as a ratio to the forward (EMA, a prior
before the first update). The margin is FixedCosts' (mean + 2.33 sd of the whole batch's
time minus its prediction, at least its 99th percentile over the last 128 batches): the
same rule AdaShadow's deadline plans use, reused, not copied.

Pure bookkeeping on numbers and a clock's readings: no model is touched here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tta_core.runtime.deadline import DeadlineBudget
from tta_core.runtime.fixed_costs import FixedCosts

__all__ = ["DEFAULT_SIZES", "Decision", "EntropyWatch", "ServingPlan", "SizeTimes",
           "check_sizes", "choose", "largest_fitting"]

DEFAULT_SIZES = (1.0, 0.7, 0.5, 0.3)


def check_sizes(sizes: Sequence[float]) -> tuple[float, ...]:
    """The sizes, largest first; ValueError naming a size outside (0, 1], a repeat, or an
    empty list."""
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0.0 < s <= 1.0:
            raise ValueError(f"size {s!r} must be a share of filters in (0, 1]")
        if float(s) in out:
            raise ValueError(f"size {s!r} is listed twice in {tuple(sizes)}")
        out.append(float(s))
    if not out:
        raise ValueError("sizes is empty: give at least one share of filters, e.g. (1.0,)")
    return tuple(sorted(out, reverse=True))


def largest_fitting(sizes: Sequence[float], predicted_ms: Mapping[float, float],
                    room_ms: float) -> float:
    """The largest size whose predicted time is within `room_ms`; the largest size when
    there is no deadline (NaN), the smallest (fastest) when none fits."""
    if math.isnan(room_ms):
        return max(sizes)
    fitting = [s for s in sizes if predicted_ms[s] <= room_ms]
    return max(fitting) if fitting else min(sizes)


@dataclass(frozen=True)
class Decision:
    """What one batch does: serve `keep`, adapt it or not, and why (the figures)."""

    keep: float
    adapt: bool
    deadline_ms: float  # what is left of the batch's deadline (NaN: none)
    margin_ms: float
    predicted_ms: float  # forward (+ update when adapting) of the decision
    pinned: bool = False


def choose(sizes: Sequence[float], forward_ms: Mapping[float, float],
           update_ms: Mapping[float, float], deadline_ms: float, margin_ms: float,
           want_adapt: bool, pinned: float | None = None) -> Decision:
    """Serve the pinned size, else the largest whose forward fits deadline - margin;
    adapt when wanted and the forward plus the update fit too (always, without deadline)."""
    room = deadline_ms - margin_ms
    keep = pinned if pinned is not None else largest_fitting(sizes, forward_ms, room)
    total = forward_ms[keep] + update_ms[keep]
    adapt = want_adapt and (math.isnan(room) or total <= room)
    return Decision(keep, adapt, deadline_ms, margin_ms,
                    total if adapt else forward_ms[keep], pinned is not None)


@dataclass
class SizeTimes:
    """Per-size forward and update time predictions (module docstring)."""

    alpha: float = 0.2  # EMA weight of the newest served batch
    # ... when it was slower than predicted: a slower machine is believed quickly (a late
    # batch costs a frame; a smaller size than needed only some accuracy), a faster one
    # gradually
    alpha_up: float = 0.5
    update_prior: float = 4.0  # update / forward time before an update was measured
    base: dict[tuple[float, int], float] = field(default_factory=dict)  # (keep, n) -> ms
    load: float = 1.0
    update_ratio: dict[float, float] = field(default_factory=dict)
    last_n: int = 0  # frames of the last observed batch

    def measured(self, n: int) -> bool:
        """Whether batch size n has warm-up base times."""
        return any(b == n for _, b in self.base)

    def set_base(self, keep: float, n: int, ms: float) -> None:
        """The warm-up forward time of size `keep` at batch size n."""
        if not (math.isfinite(ms) and ms > 0):
            raise ValueError(f"warm-up forward time {ms!r} ms of size {keep} must be > 0")
        self.base[(keep, n)] = float(ms)

    def base_ms(self, keep: float, n: int) -> float:
        """Warm-up time of (keep, n); from the nearest measured batch size otherwise, on the
        safe side: a larger one's time as is, a smaller one's scaled by n / its size."""
        if (keep, n) in self.base:
            return self.base[(keep, n)]
        known = sorted(b for k, b in self.base if k == keep)
        if not known:
            raise KeyError(f"no warm-up time for size {keep}")
        larger = [b for b in known if b > n]
        if larger:
            return self.base[(keep, larger[0])]
        return self.base[(keep, known[-1])] * n / known[-1]

    def forward_ms(self, keep: float, n: int) -> float:
        """Predicted forward of size `keep` on n frames now."""
        return self.base_ms(keep, n) * self.load

    def update_ms(self, keep: float, n: int) -> float:
        """Predicted update (after the served forward) of size `keep` on n frames now."""
        return self.forward_ms(keep, n) * self.update_ratio.get(keep, self.update_prior)

    def observe_forward(self, keep: float, n: int, ms: float) -> None:
        """A served batch's forward took `ms`: fold measured / base into the load."""
        if math.isfinite(ms) and ms > 0:
            ratio = ms / self.base_ms(keep, n)
            a = max(self.alpha, self.alpha_up) if ratio > self.load else self.alpha
            self.load = (1.0 - a) * self.load + a * ratio

    def observe_update(self, keep: float, forward_ms: float, update_ms: float) -> None:
        """An update after a forward of `forward_ms` took `update_ms`."""
        if not (math.isfinite(update_ms) and forward_ms > 0):
            return
        ratio = update_ms / forward_ms
        old = self.update_ratio.get(keep)
        self.update_ratio[keep] = ratio if old is None else (
            (1.0 - self.alpha) * old + self.alpha * ratio)


@dataclass
class EntropyWatch:
    """Flags a domain change from the served batches' mean entropy: per size an EMA, whose
    value `settle` batches after a derivation becomes that size's reference; a later EMA
    more than `jump` nats away from it flags. Per size, because smaller surrogates are
    less sure of themselves: a switch of size alone must not look like a new domain."""

    jump: float = 0.3  # nats; <= 0: never flags
    alpha: float = 0.3
    settle: int = 4
    ema: dict[float, float] = field(default_factory=dict)
    seen: dict[float, int] = field(default_factory=dict)
    ref: dict[float, float] = field(default_factory=dict)

    def observe(self, keep: float, entropy: float) -> bool:
        """Fold in a batch served at `keep`; True when its entropy jumped."""
        if not math.isfinite(entropy):
            return False
        old = self.ema.get(keep)
        self.ema[keep] = entropy if old is None else (
            (1.0 - self.alpha) * old + self.alpha * entropy)
        self.seen[keep] = self.seen.get(keep, 0) + 1
        if keep not in self.ref:
            if self.seen[keep] >= self.settle:
                self.ref[keep] = self.ema[keep]
            return False
        return self.jump > 0 and abs(self.ema[keep] - self.ref[keep]) > self.jump

    def clear(self) -> None:
        """A new derivation: references are learnt afresh."""
        self.ema.clear()
        self.seen.clear()
        self.ref.clear()


class ServingPlan(DeadlineBudget):
    """The serving side of the elastic method: the batch's deadline (DeadlineBudget: the
    deadline modes, the vehicle's speed, the lateness of a backlog), the size pinned by a
    scheduler (`set_size`), the time predictions, the margin (FixedCosts)."""

    def __init__(self, config: object, sizes: Sequence[float], alpha: float = 0.2,
                 update_prior: float = 4.0) -> None:
        self.config = config  # DeadlineConfig fields (deadline_mode, camera_hz, ...)
        self.sizes = check_sizes(sizes)
        self.fixed = FixedCosts(alpha=alpha, warmup=0)
        self.times = SizeTimes(alpha=alpha, update_prior=update_prior)
        self.pinned: float | None = None
        self.rederive_ms = math.nan  # EMA of a re-derivation's time (NaN: none yet)

    def set_size(self, keep: float | None) -> None:
        """Serve `keep` from the next batch on (None: the deadline's choice again)."""
        if keep is not None and float(keep) not in self.sizes:
            raise ValueError(f"size {keep!r} is not one of the served sizes {self.sizes}")
        self.pinned = None if keep is None else float(keep)

    def forward_ms(self, n: int) -> dict[float, float]:
        """Predicted forward per size on n frames (needs the warm-up of some batch size)."""
        return {k: self.times.forward_ms(k, n) for k in self.sizes}

    def decide(self, n: int, want_adapt: bool) -> Decision:
        """Size and update of the next batch of n frames (`choose`)."""
        deadline, margin = self.budget_ms(n)
        update = {k: self.times.update_ms(k, n) for k in self.sizes}
        return choose(self.sizes, self.forward_ms(n), update, deadline, margin, want_adapt,
                      self.pinned)

    def room_for(self, decision: Decision, extra_ms: float) -> bool:
        """Whether `extra_ms` more (a re-derivation) still fits the decision's deadline."""
        if math.isnan(decision.deadline_ms):
            return True
        extra = 0.0 if math.isnan(extra_ms) else extra_ms
        return decision.predicted_ms + extra <= decision.deadline_ms - decision.margin_ms

    def without_update(self, decision: Decision, n: int) -> Decision:
        """The decision with its update dropped (its prediction the forward alone)."""
        return replace(decision, adapt=False,
                       predicted_ms=self.times.forward_ms(decision.keep, n))

    def observe(self, decision: Decision, n: int, step_ms: float, total_ms: float) -> None:
        """What the batch took: `step_ms` the served forward (with its update when it
        adapted), `total_ms` the whole batch. A forward alone feeds the load, a forward
        with update the size's update ratio, the whole batch against its prediction the
        margin (deadline modes only)."""
        self.times.last_n = n
        forward = self.times.forward_ms(decision.keep, n)
        if decision.adapt:
            self.times.observe_update(decision.keep, forward, step_ms - forward)
        else:
            self.times.observe_forward(decision.keep, n, step_ms)
        if not math.isnan(decision.deadline_ms):
            self.fixed.update_total(decision.predicted_ms, total_ms, forward)

    def observe_rederive(self, ms: float) -> None:
        """A re-derivation took `ms` (EMA, weight alpha)."""
        if math.isfinite(ms) and ms >= 0:
            a = self.times.alpha
            self.rederive_ms = ms if math.isnan(self.rederive_ms) else (
                (1.0 - a) * self.rederive_ms + a * ms)

    def reset(self) -> None:
        """Forget the learnt load, ratios and margin (warm-up times stay: same machine)."""
        self.times.load = 1.0
        self.times.update_ratio.clear()
        self.fixed.reset()
        self.rederive_ms = math.nan

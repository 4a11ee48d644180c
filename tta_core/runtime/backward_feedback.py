"""Closed-loop correction of the predicted backward time by the backwards measured so far.

The runtime predictor (predictor.planning_times) scales the offline profile by telemetry
and by the forward measured on the batch. What it cannot see is a difference between how
the forward and the backward slow down: on a shared machine under compute- and memory-
bound competitors the sparse backward of a small net slows more than the forward of the
same batches (`tta predictor-bench`), and a profile taken a minute earlier can be off
even on an idle machine. Both persist over many batches, so
the ratio measured / predicted backward of past plans is a good correction for the next
plan: this is AdaShadow's predictor with its own error fed back, so the planner's budget
holds in the median and not only in the profile.

The factor is an EMA of log(measured / predicted) (multiplicative errors, symmetric for
over- and under-prediction), clipped to [1/max_factor, max_factor] so one outlier batch
(a page fault, a preemption) cannot wreck the next plans. It is a property of the machine
now, not of the model: resetting the model keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class BackwardFeedback:
    """Multiplicative correction of predicted backward times; alpha = 0 disables it."""

    alpha: float = 0.2  # EMA weight of the newest batch
    max_factor: float = 4.0  # the factor stays within [1/max_factor, max_factor]
    factor: float = 1.0
    updates: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.alpha) and 0.0 <= self.alpha <= 1.0):
            raise ValueError(f"backward feedback alpha must be in [0, 1], got {self.alpha!r}")
        if not (math.isfinite(self.max_factor) and self.max_factor >= 1.0):
            raise ValueError(f"backward feedback max_factor must be >= 1, got "
                             f"{self.max_factor!r}")

    def update(self, predicted_ms: float, measured_ms: float) -> float:
        """Fold in one batch and return the new factor. `predicted_ms` is what the plan
        was made with (this factor already applied). Pairs that are not finite and > 0
        (no backward ran) are ignored."""
        if self.alpha == 0.0 or not (math.isfinite(predicted_ms) and predicted_ms > 0
                                     and math.isfinite(measured_ms) and measured_ms > 0):
            return self.factor
        # the plan was predicted with the current factor: the new evidence about the
        # uncorrected predictor is measured / (predicted / factor)
        target = math.log(measured_ms / predicted_ms * self.factor)
        bound = math.log(self.max_factor)
        logf = (1.0 - self.alpha) * math.log(self.factor) + self.alpha * target
        self.factor = math.exp(min(bound, max(-bound, logf)))
        self.updates += 1
        return self.factor

    def reset(self) -> None:
        """Back to no correction (a new machine or profile)."""
        self.factor, self.updates = 1.0, 0

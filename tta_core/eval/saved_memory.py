"""Measured saved-activation memory of a bench run (`tta bench --measure-activations`).

Each method's step runs inside a tta_core.memory SavedActivationCounter over its model: what
autograd saves for backward during the step (every forward of it, in the calling thread),
deduplicated by storage, parameters and buffers excluded. Saved-tensor hooks nest and only
the innermost apply, so a method that holds its saves under its own codec (surgeon) is
invisible to the counter; such a method reports the bytes its codec stored (after
compression) in `StepResult.stats["saved_bytes"]`, which are added. The two never overlap.

Not seen: saves made in another thread (AdaShadow's parallel mode adapts in one).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tta_core.memory import SavedActivationCounter

MIB = 2**20


@dataclass
class SavedMemory:
    """Per-batch saved-activation figures of one run (MiB)."""

    measured: list[float] = field(default_factory=list)  # the bench's hooks
    reported: list[float] = field(default_factory=list)  # the method's own codec (0: none)
    analytic: list[float] = field(default_factory=list)  # dense ∂W inputs, from shapes
    method_peak: list[float] = field(default_factory=list)  # stats["peak_saved_mib"]
    budget_mib: float | None = None  # `tta bench --memory-budget-mb`: share of batches in it

    def totals(self) -> list[float]:
        """Saved MiB per batch: measured + method-reported."""
        return [m + r for m, r in zip(self.measured, self.reported, strict=True)]

    def summary(self) -> dict[str, Any]:
        """JSON-ready means and maxima (MiB) over the batches."""
        tot = self.totals()
        out: dict[str, Any] = {
            "saved_mib_mean": _mean(tot), "saved_mib_max": max(tot, default=math.nan),
            "measured_mib_mean": _mean(self.measured),
            "reported_mib_mean": _mean(self.reported),
            "analytic_mib_mean": _mean(self.analytic), "batches": len(tot),
            "saved_mib": tot}
        if self.method_peak:
            out["method_peak_saved_mib_max"] = max(self.method_peak)
        if self.budget_mib is not None:
            out["budget_mib"] = self.budget_mib
            out["within_budget_share"] = (sum(t <= self.budget_mib for t in tot) / len(tot)
                                          if tot else math.nan)
        return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


class ActivationMeter:
    """Wraps method steps in a SavedActivationCounter over `model`; off: does nothing."""

    def __init__(self, model: nn.Module, enabled: bool, budget_mib: float | None = None
                 ) -> None:
        """`budget_mib`: the bench's memory budget (the summary's share of batches in it)."""
        self.counter = SavedActivationCounter(model) if enabled else None
        self.memory = SavedMemory(budget_mib=budget_mib)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Count the saves of the step run inside."""
        with self.counter if self.counter is not None else nullcontext():
            yield

    def note(self, stats: dict[str, Any]) -> None:
        """Record the batch just stepped (`stats`: its StepResult.stats)."""
        if self.counter is None:
            return
        res = self.counter.result
        mem = self.memory
        mem.measured.append(res.total / MIB if res is not None else 0.0)
        mem.analytic.append(res.analytic / MIB if res is not None else 0.0)
        mem.reported.append(float(stats.get("saved_bytes", 0)) / MIB)
        if "peak_saved_mib" in stats:
            mem.method_peak.append(float(stats["peak_saved_mib"]))

    def meta(self) -> dict[str, Any] | None:
        """The run's summary for RunRecord.meta["saved_activations"]; None when off."""
        return self.memory.summary() if self.counter is not None else None


SAVED_NOTE = (
    "\nsaved MiB (mean/max): measured bytes per batch, not analytic: what autograd saved "
    "for backward during each step, counted by saved-tensor hooks over the method's model "
    "(storages deduplicated, parameters and buffers excluded, every forward of the step "
    "summed: SAR's two SAM passes count both). A method that stores its saves through its "
    "own codec (surgeon) reports the bytes it stored after compression (its adaptation "
    "forward; its importance pass, freed before, is `method_peak_saved_mib_max` in "
    "report.json); the bench's hooks cannot see those (the innermost hooks win), so they "
    "are added. Analytic figures (dense inputs of ∂W layers, from shapes, as papers count) "
    "are `analytic_mib_mean` in report.json. Saves in another thread (AdaShadow parallel "
    "mode) are not counted. `peak MB` is process RSS growth, a different quantity. "
    "`in mem budget %` (with --memory-budget-mb): the share of batches whose saved MiB "
    "(measured + reported) were within the budget, for every method, whether it takes "
    "the budget (adashadow) or not.\n")


def saved_note(measured: bool) -> str:
    """The report text that says what the saved-MiB column counts; '' when not measured."""
    return SAVED_NOTE if measured else ""

"""Live telemetry for inline planning outside ROS (`tta bench --telemetry`).

On a robot the resource monitor publishes pi1/pi2 and perception hands them to its
method; here a TelemetrySampler plays the monitor: before a batch (at most every
`period_s`), the latest sample's expansion factors go to a method that takes telemetry
(tta_core.api.TakesTelemetry). Unknown factors (NaN: no calibration, no counters) count
as 1, as on the ROS path (planning.telemetry_pis)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tta_core.adashadow.calibration import load_calibration
from tta_core.adashadow.expansion import ExpansionModel
from tta_core.adashadow.planning import telemetry_pis
from tta_core.api import TakesTelemetry
from tta_core.telemetry import TelemetrySampler
from tta_core.telemetry.sample import ResourceSample


class Sampler(Protocol):
    """What LiveExpansion reads (TelemetrySampler, or a fake input in tests)."""

    def sample(self) -> ResourceSample: ...


@dataclass
class LiveExpansion:
    """Feeds sampled pi1/pi2 to methods that plan with telemetry; keeps what it fed."""

    sampler: Sampler
    period_s: float = 0.5
    fed: list[tuple[float, float]] = field(default_factory=list)
    _last: float = -math.inf
    _pis: tuple[float, float] = (1.0, 1.0)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.period_s) and self.period_s >= 0):
            raise ValueError(f"telemetry period_s must be >= 0, got {self.period_s!r}")

    @classmethod
    def from_calibration(cls, path: str | Path | None, threads: int = 0) -> LiveExpansion:
        """A real sampler whose expansion model is referenced to `tta calibrate`'s file
        (None: the default calibration, pi1 from frequency and competing processes)."""
        model = (ExpansionModel(calibration=load_calibration(path), threads=threads)
                 if path else ExpansionModel(threads=threads))
        return cls(TelemetrySampler(expansion=model))

    def feed(self, method: object) -> None:
        """Give `method` the current factors (sampling again once period_s has passed)."""
        if not isinstance(method, TakesTelemetry):
            return
        now = time.monotonic()
        if now - self._last >= self.period_s:
            self._last = now
            s = self.sampler.sample()
            self._pis = telemetry_pis(s.compute_expansion, s.memory_expansion)
        method.set_expansion(*self._pis)
        self.fed.append(self._pis)

    def summary(self) -> dict[str, float]:
        """Mean and max of the pi1/pi2 fed (for the run's metadata)."""
        if not self.fed:
            return {}
        p1, p2 = zip(*self.fed, strict=True)
        return {"pi1_mean": sum(p1) / len(p1), "pi1_max": max(p1),
                "pi2_mean": sum(p2) / len(p2), "pi2_max": max(p2), "batches": len(p1)}

    def close(self) -> None:
        close = getattr(self.sampler, "close", None)
        if close is not None:
            close()

"""TelemetrySampler: merges the optional sources into one ResourceSample.

Sources are asked in priority order; each field takes the first known (finite / non-empty)
value. A source that raises is recorded in `describe()` and skipped: `sample()` never raises.
With a Calibration, pi_1 / pi_2 are filled from tta_core.predictor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tta_core.telemetry.jtop_source import JtopSource
from tta_core.telemetry.nvml_source import NvmlSource
from tta_core.telemetry.perf_source import PerfSource
from tta_core.telemetry.psutil_source import PsutilSource
from tta_core.telemetry.sample import (
    MEASURED_FIELDS,
    ResourceSample,
    SourceStatus,
    TelemetrySource,
    is_known,
)
from tta_core.telemetry.sysfs_source import SysfsSource


def default_sources(
    sysfs_root: str | Path = "/sys",
    own_pids: Iterable[int] | None = None,
    perf_pid: int | None = None,
    gpu_index: int = 0,
) -> list[TelemetrySource]:
    """psutil, sysfs, NVML, jtop, perf: every one constructed, unavailable ones stay silent."""
    return [
        PsutilSource(own_pids=own_pids),
        SysfsSource(sysfs_root),
        NvmlSource(gpu_index),
        JtopSource(),
        PerfSource(perf_pid),
    ]


def merge_readings(readings: Sequence[tuple[str, dict[str, Any]]]) -> ResourceSample:
    """First known value per field, in the given order; `source` lists who contributed."""
    sample = ResourceSample()
    answered: list[str] = []
    for name, values in readings:
        contributed = False
        for key, value in values.items():
            if key not in MEASURED_FIELDS:
                raise ValueError(f"source {name!r} returned unknown field {key!r}")
            if not is_known(value):
                continue
            contributed = True
            if not is_known(getattr(sample, key)):
                setattr(sample, key, list(value) if isinstance(value, list | tuple)
                        else float(value))
        if contributed:
            answered.append(name)
    sample.source = "+".join(answered)
    return sample


class TelemetrySampler:
    """Cheap combined sampler (meant for ~10 Hz). Close it to release counters/handles."""

    def __init__(
        self,
        sources: Sequence[TelemetrySource] | None = None,
        calibration: Any = None,
        **default_kwargs: Any,
    ) -> None:
        self.sources = list(sources) if sources is not None else default_sources(**default_kwargs)
        self.calibration = calibration
        self._errors: dict[str, str] = {}

    def sample(self) -> ResourceSample:
        """One merged sample; failing sources are skipped and remembered."""
        readings: list[tuple[str, dict[str, Any]]] = []
        for src in self.sources:
            try:
                readings.append((src.name, src.read()))
                self._errors.pop(src.name, None)
            except Exception as exc:  # a sampler must not take the monitor down
                self._errors[src.name] = f"{type(exc).__name__}: {exc}"
        sample = merge_readings(readings)
        if self.calibration is not None:
            self._fill_expansion(sample)
        return sample

    def _fill_expansion(self, sample: ResourceSample) -> None:
        from tta_core.predictor import compute_expansion, memory_expansion

        n = sample.competing_processes
        try:
            pi1 = compute_expansion(sample.cpu_freq_mhz, n if math.isfinite(n) else 0,
                                    self.calibration)
            pi2 = memory_expansion(sample.cache_hit_rate, self.calibration)
        except (ValueError, TypeError) as exc:
            self._errors["predictor"] = str(exc)
            return
        sample.compute_expansion = float(pi1) if math.isfinite(pi1) else sample.compute_expansion
        sample.memory_expansion = float(pi2) if math.isfinite(pi2) else sample.memory_expansion

    def describe(self) -> list[SourceStatus]:
        """Status of each source (+ the last error it raised in sample())."""
        out = []
        for src in self.sources:
            st = src.describe()
            if src.name in self._errors:
                st.last_error = self._errors[src.name]
            out.append(st)
        return out

    def close(self) -> None:
        for src in self.sources:
            src.close()

    def __enter__(self) -> TelemetrySampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

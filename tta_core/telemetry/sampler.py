"""TelemetrySampler: merges the optional sources into one ResourceSample.

Sources are asked in priority order; each field takes the first known (finite / non-empty)
value. A source that raises is recorded in `describe()` and skipped: `sample()` never raises.
With an expansion model (anything with the `ExpansionEstimator` shape, e.g.
tta_core.adashadow.expansion.ExpansionModel), compute_expansion / memory_expansion (pi_1 /
pi_2) are filled; telemetry itself knows no latency model, so it imports nothing from
AdaShadow. An optional BandwidthProbe feeds pi_2 where the LLC hit rate is unknown: run at
most every `probe_interval_s`, the mean of the last `probe_window` runs is used.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from tta_core.telemetry.bandwidth_probe import BandwidthProbe
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


class ExpansionResult(Protocol):
    """One evaluation of an expansion model: the factors the sampler copies into a sample."""

    @property
    def pi1(self) -> float: ...

    @property
    def pi2(self) -> float: ...


class ExpansionEstimator(Protocol):
    """What the sampler needs of an expansion model (duck-typed, so telemetry stays generic).

    `pi2_mode` "probe" asks for the probe bandwidth where the LLC hit rate is unknown;
    `evaluate` must not raise for unknown (NaN) readings.
    """

    @property
    def pi2_mode(self) -> str: ...

    def evaluate(self, sample: ResourceSample, probe_bw_gbs: float) -> ExpansionResult: ...


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
    """Cheap combined sampler (meant for ~10 Hz). Close it to release counters/handles.

    `expansion` (an ExpansionEstimator) fills pi_1 / pi_2; without one they stay NaN.
    `probe` see the module doc.
    """

    def __init__(
        self,
        sources: Sequence[TelemetrySource] | None = None,
        *,
        expansion: ExpansionEstimator | None = None,
        probe: BandwidthProbe | None = None,
        probe_interval_s: float = 1.0,
        probe_window: int = 4,
        **default_kwargs: Any,
    ) -> None:
        if not probe_interval_s >= 0:
            raise ValueError(f"probe_interval_s must be >= 0, got {probe_interval_s!r}")
        if probe_window < 1:
            raise ValueError(f"probe_window must be >= 1, got {probe_window!r}")
        self.sources = list(sources) if sources is not None else default_sources(**default_kwargs)
        self.expansion = expansion
        self.probe = probe
        self.probe_interval_s = float(probe_interval_s)
        self.probe_window = int(probe_window)
        self.last_expansion: ExpansionResult | None = None
        self._probe_bws: list[float] = []
        self._probe_t = -math.inf
        self._errors: dict[str, str] = {}

    @property
    def errors(self) -> dict[str, str]:
        """Last error per failing part (source names, 'probe', 'expansion')."""
        return dict(self._errors)

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
        if self.expansion is not None:
            self._fill_expansion(sample, self.expansion)
        return sample

    def probe_bandwidth(self) -> float:
        """Mean probe bandwidth (GB/s) of the last runs; runs the probe when it is due.

        NaN without a probe or before a run succeeded.
        """
        if self.probe is None:
            return math.nan
        now = time.monotonic()
        if now - self._probe_t >= self.probe_interval_s:
            self._probe_t = now
            try:
                self._probe_bws.append(float(self.probe.measure()))
                self._errors.pop("probe", None)
            except Exception as exc:  # e.g. MemoryError: pi2 falls back, the sampler lives
                self._errors["probe"] = f"{type(exc).__name__}: {exc}"
            del self._probe_bws[:-self.probe_window]
        return sum(self._probe_bws) / len(self._probe_bws) if self._probe_bws else math.nan

    def _fill_expansion(self, sample: ResourceSample, model: ExpansionEstimator) -> None:
        bw = math.nan
        if model.pi2_mode == "probe" and not 0.0 <= sample.cache_hit_rate <= 1.0:
            bw = self.probe_bandwidth()  # only where the hit rate cannot give pi2
        try:
            ex = model.evaluate(sample, bw)
        except (ValueError, TypeError) as exc:  # defensive: evaluate degrades to 1, not raise
            self._errors["expansion"] = f"{type(exc).__name__}: {exc}"
            return
        self._errors.pop("expansion", None)
        self.last_expansion = ex
        sample.compute_expansion = ex.pi1
        sample.memory_expansion = ex.pi2

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

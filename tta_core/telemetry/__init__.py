"""Resource telemetry for the latency predictor and the resource monitor node.

Sources (each optional, none raises from sample()): psutil (CPU, memory, competing
processes), sysfs (thermal zones, cpufreq, GPU devfreq; root is a parameter), NVML
(`pynvml`), jtop (Jetson), perf_event (LLC hit rate). Unknown values are NaN.
BandwidthProbe (DRAM copy bandwidth) stands in for the hit rate where no PMU exists; the
sampler turns a sample into pi1 / pi2 with the expansion model it is given (an
ExpansionEstimator such as tta_core.adashadow.expansion.ExpansionModel): telemetry imports
nothing from AdaShadow.
"""

from tta_core.telemetry.bandwidth_probe import BandwidthProbe
from tta_core.telemetry.caches import cache_sizes
from tta_core.telemetry.jtop_source import JtopSource, parse_jtop
from tta_core.telemetry.nvml_source import NvmlSource
from tta_core.telemetry.perf_source import PerfSource, cache_hit_rate
from tta_core.telemetry.psutil_source import PsutilSource, competing_pids
from tta_core.telemetry.sample import ResourceSample, SourceStatus, TelemetrySource
from tta_core.telemetry.sampler import (
    ExpansionEstimator,
    ExpansionResult,
    TelemetrySampler,
    default_sources,
    merge_readings,
)
from tta_core.telemetry.sysfs_source import SysfsSource

__all__ = [
    "BandwidthProbe",
    "ExpansionEstimator",
    "ExpansionResult",
    "JtopSource",
    "NvmlSource",
    "PerfSource",
    "PsutilSource",
    "ResourceSample",
    "SourceStatus",
    "SysfsSource",
    "TelemetrySampler",
    "TelemetrySource",
    "cache_hit_rate",
    "cache_sizes",
    "competing_pids",
    "default_sources",
    "merge_readings",
    "parse_jtop",
]

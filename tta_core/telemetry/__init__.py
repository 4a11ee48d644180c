"""Resource telemetry for the latency predictor and the resource monitor node.

Sources (each optional, none raises from sample()): psutil (CPU, memory, competing
processes), sysfs (thermal zones, cpufreq, GPU devfreq; root is a parameter), NVML
(`pynvml`), jtop (Jetson), perf_event (LLC hit rate). Unknown values are NaN.
"""

from tta_core.telemetry.jtop_source import JtopSource, parse_jtop
from tta_core.telemetry.nvml_source import NvmlSource
from tta_core.telemetry.perf_source import PerfSource, cache_hit_rate
from tta_core.telemetry.psutil_source import PsutilSource, competing_pids
from tta_core.telemetry.sample import ResourceSample, SourceStatus, TelemetrySource
from tta_core.telemetry.sampler import TelemetrySampler, default_sources, merge_readings
from tta_core.telemetry.sysfs_source import SysfsSource

__all__ = [
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
    "competing_pids",
    "default_sources",
    "merge_readings",
    "parse_jtop",
]

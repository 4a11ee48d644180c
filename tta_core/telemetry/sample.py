"""ResourceSample (mirrors DESIGN §7 ResourceTelemetry) and the source protocol.

Unknown values are NaN, never 0, so a consumer can tell "idle" from "not measured".
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

NAN = float("nan")


@dataclass
class ResourceSample:
    """One telemetry sample. Field names follow the ResourceTelemetry message.

    `competing_processes` is an integral count stored as float so that "unknown" can be NaN
    (the ROS message field is uint32: the publishing node maps NaN to its own convention).
    `stamp` is wall-clock seconds (time.time()) for the message header.
    """

    source: str = ""
    cpu_percent: float = NAN
    cpu_percent_per_core: list[float] = field(default_factory=list)
    gpu_percent: float = NAN
    cpu_temp_c: float = NAN
    gpu_temp_c: float = NAN
    cpu_freq_mhz: float = NAN
    cpu_freq_max_mhz: float = NAN
    gpu_freq_mhz: float = NAN
    gpu_freq_max_mhz: float = NAN
    competing_processes: float = NAN
    cache_hit_rate: float = NAN
    mem_used_mb: float = NAN
    mem_total_mb: float = NAN
    gpu_mem_used_mb: float = NAN
    power_w: float = NAN
    compute_expansion: float = NAN
    memory_expansion: float = NAN
    stamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (NaN kept as float nan)."""
        return asdict(self)


#: Names of the fields a source may fill (everything except bookkeeping).
MEASURED_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(ResourceSample) if f.name not in ("source", "stamp")
)


@dataclass
class SourceStatus:
    """What a source reports about itself (for /diagnostics)."""

    name: str
    available: bool
    detail: str  # "ok: ..." or "unavailable: <reason>"
    last_error: str = ""


class TelemetrySource(Protocol):
    """A sampler of some fields. `read` returns only the fields it measured."""

    name: str

    def read(self) -> dict[str, Any]: ...

    def describe(self) -> SourceStatus: ...

    def close(self) -> None: ...


def is_known(value: Any) -> bool:
    """True when a field value carries information (finite number or non-empty list)."""
    if isinstance(value, list | tuple):
        return len(value) > 0
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def to_float(value: Any) -> float:
    """float(value), or NaN for None / non-numeric strings such as jtop's 'OFF'."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return NAN

"""sysfs source: thermal zones, CPU cpufreq and (Jetson) GPU devfreq.

Root path is a parameter so tests can build a fake tree. Files are discovered once at
construction; each sample only reads the small files found then.

- CPU temperature: max over thermal zones whose `type` names a CPU/SoC sensor
  (contains "cpu", "x86_pkg", "soc", "k10temp", "coretemp" or "tctl"); GPU temperature: max
  over zones whose type contains "gpu". Zone `temp` is in millidegrees Celsius.
- CPU frequency: mean of cpu*/cpufreq/scaling_cur_freq; max: max of cpuinfo_max_freq (kHz).
- GPU frequency: class/devfreq/<dev>/cur_freq and max_freq (Hz) for devices whose name
  contains "gpu" or an NVIDIA iGPU id (gv11b, ga10b, gp10b, gm20b).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tta_core.telemetry.sample import NAN, SourceStatus

_CPU_ZONE_KEYS = ("cpu", "x86_pkg", "soc", "k10temp", "coretemp", "tctl")
_GPU_ZONE_KEYS = ("gpu",)
_GPU_DEVFREQ_KEYS = ("gpu", "gv11b", "ga10b", "gp10b", "gm20b")


def _read_number(path: Path) -> float:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return NAN


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


class SysfsSource:
    """Temperatures and clock frequencies from a sysfs tree rooted at `root`."""

    name = "sysfs"

    def __init__(self, root: str | Path = "/sys") -> None:
        self.root = Path(root)
        self.cpu_zones: list[Path] = []
        self.gpu_zones: list[Path] = []
        for zone in sorted(self.root.glob("class/thermal/thermal_zone*")):
            try:
                kind = (zone / "type").read_text().strip().lower()
            except OSError:
                continue
            if any(k in kind for k in _GPU_ZONE_KEYS):
                self.gpu_zones.append(zone / "temp")
            elif any(k in kind for k in _CPU_ZONE_KEYS):
                self.cpu_zones.append(zone / "temp")
        cpus = sorted(self.root.glob("devices/system/cpu/cpu[0-9]*/cpufreq"))
        self.cpu_cur = [c / "scaling_cur_freq" for c in cpus if (c / "scaling_cur_freq").exists()]
        self.cpu_max_khz = max(_finite([_read_number(c / "cpuinfo_max_freq") for c in cpus]),
                               default=NAN)
        self.gpu_devfreq = [
            d for d in sorted(self.root.glob("class/devfreq/*"))
            if any(k in d.name.lower() for k in _GPU_DEVFREQ_KEYS) and (d / "cur_freq").exists()
        ]

    @property
    def available(self) -> bool:
        return bool(self.cpu_zones or self.gpu_zones or self.cpu_cur or self.gpu_devfreq)

    def read(self) -> dict[str, Any]:
        """Values of the files found at construction (NaN where none)."""
        out: dict[str, Any] = {}
        cpu_t = _finite([_read_number(p) for p in self.cpu_zones])
        gpu_t = _finite([_read_number(p) for p in self.gpu_zones])
        out["cpu_temp_c"] = max(cpu_t) / 1000.0 if cpu_t else NAN
        out["gpu_temp_c"] = max(gpu_t) / 1000.0 if gpu_t else NAN
        cur = _finite([_read_number(p) for p in self.cpu_cur])
        out["cpu_freq_mhz"] = sum(cur) / len(cur) / 1000.0 if cur else NAN
        out["cpu_freq_max_mhz"] = self.cpu_max_khz / 1000.0
        if self.gpu_devfreq:
            dev = self.gpu_devfreq[0]
            out["gpu_freq_mhz"] = _read_number(dev / "cur_freq") / 1e6
            out["gpu_freq_max_mhz"] = _read_number(dev / "max_freq") / 1e6
        return out

    def describe(self) -> SourceStatus:
        if not self.available:
            return SourceStatus(
                self.name, False,
                f"unavailable: no thermal zones, cpufreq or GPU devfreq under {self.root}",
            )
        return SourceStatus(
            self.name, True,
            f"ok: {len(self.cpu_zones)} CPU + {len(self.gpu_zones)} GPU thermal zones, "
            f"{len(self.cpu_cur)} cpufreq cores, {len(self.gpu_devfreq)} GPU devfreq under "
            f"{self.root}",
        )

    def close(self) -> None:
        pass

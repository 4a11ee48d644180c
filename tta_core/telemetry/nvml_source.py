"""NVML source (desktop/server NVIDIA GPUs) through the optional `pynvml` module
(package nvidia-ml-py). Each query is guarded separately: some GPUs do not support every one.
"""

from __future__ import annotations

from typing import Any

from tta_core.telemetry.sample import NAN, SourceStatus

_CLOCK_SM = 1  # NVML_CLOCK_SM
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU


class NvmlSource:
    """GPU load, temperature, SM clock, memory and power of GPU `index`."""

    name = "nvml"

    def __init__(self, index: int = 0) -> None:
        if index < 0:
            raise ValueError(f"GPU index must be >= 0, got {index!r}")
        self.index = index
        self.reason = ""
        self._nv: Any = None
        self._handle: Any = None
        self._max_clock = NAN
        self.errors: dict[str, str] = {}
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            self.reason = "unavailable: pynvml (nvidia-ml-py) is not installed"
            return
        try:
            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # NVMLError subclasses vary by driver
            self.reason = f"unavailable: NVML init failed for GPU {index}: {exc}"
            return
        self._nv = pynvml
        self._max_clock = self._query("max_clock", lambda h: float(
            pynvml.nvmlDeviceGetMaxClockInfo(h, _CLOCK_SM)))

    def _query(self, key: str, fn: Any) -> float:
        try:
            return fn(self._handle)
        except Exception as exc:  # unsupported query on this GPU: keep NaN, remember why
            self.errors[key] = str(exc)
            return NAN

    def read(self) -> dict[str, Any]:
        if self._nv is None:
            return {}
        nv = self._nv
        return {
            "gpu_percent": self._query(
                "util", lambda h: float(nv.nvmlDeviceGetUtilizationRates(h).gpu)),
            "gpu_temp_c": self._query(
                "temp", lambda h: float(nv.nvmlDeviceGetTemperature(h, _TEMPERATURE_GPU))),
            "gpu_freq_mhz": self._query(
                "clock", lambda h: float(nv.nvmlDeviceGetClockInfo(h, _CLOCK_SM))),
            "gpu_freq_max_mhz": self._max_clock,
            "gpu_mem_used_mb": self._query(
                "mem", lambda h: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20),
            "power_w": self._query("power", lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
        }

    def describe(self) -> SourceStatus:
        if self._nv is None:
            return SourceStatus(self.name, False, self.reason)
        err = "; ".join(f"{k}: {v}" for k, v in sorted(self.errors.items()))
        return SourceStatus(self.name, True, f"ok: NVML GPU {self.index}", err)

    def close(self) -> None:
        if self._nv is not None:
            try:
                self._nv.nvmlShutdown()
            except Exception:  # shutting down twice or after a driver reset is harmless
                pass
            self._nv = None
            self.reason = "unavailable: closed"

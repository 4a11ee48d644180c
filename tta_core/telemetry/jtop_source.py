"""jtop source (NVIDIA Jetson, package jetson-stats 4.x).

`parse_jtop` is a pure function over the documented jtop 4.x structures, so it is tested on a
recorded dict without a Jetson:

- `jetson.stats` (flat dict): 'CPU1'..'CPUn' load % (int) or 'OFF' for an offline core;
  'GPU' load %; 'RAM' used/total fraction; 'Temp <sensor>' in degC (sensor names are
  'CPU'/'GPU' on Xavier and older, 'cpu'/'gpu' on Orin; jtop writes -256 for an offline
  sensor); 'Power TOT' total board power in mW.
- `jetson.cpu` (optional): {'cpu': [{'online': bool, 'freq': {'cur','max','min'} kHz}, ...]}.
- `jetson.gpu` (optional): {name: {'status': {'load': %}, 'freq': {'cur','max'} kHz}}.
- `jetson.memory` (optional): {'RAM': {'tot': KB, 'used': KB, 'shared': KB}}; on a Jetson
  'shared' is the RAM used by the integrated GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tta_core.telemetry.sample import NAN, SourceStatus, to_float

_OFFLINE_TEMP = -100.0  # jtop reports -256 for an offline thermal sensor


def _get(obj: Any, *keys: Any) -> Any:
    for key in keys:
        try:
            obj = obj[key]
        except (KeyError, IndexError, TypeError):
            return None
    return obj


def _temp(stats: Mapping[str, Any], sensor: str) -> float:
    for key, value in stats.items():
        if isinstance(key, str) and key.lower() == f"temp {sensor}":
            t = to_float(value)
            return t if t > _OFFLINE_TEMP else NAN
    return NAN


def _cpu_fields(stats: Mapping[str, Any], cpu: Any) -> dict[str, Any]:
    keys = sorted((k for k in stats if isinstance(k, str) and k[:3] == "CPU" and k[3:].isdigit()),
                  key=lambda k: int(k[3:]))
    per_core = [to_float(stats[k]) for k in keys]  # 'OFF' -> NaN
    online = [v for v in per_core if math.isfinite(v)]
    out: dict[str, Any] = {"cpu_percent_per_core": per_core,
                           "cpu_percent": sum(online) / len(online) if online else NAN}
    cores = [c for c in (_get(cpu, "cpu") or []) if _get(c, "online")]
    cur = [to_float(_get(c, "freq", "cur")) for c in cores]
    mx = [to_float(_get(c, "freq", "max")) for c in cores]
    cur, mx = [v for v in cur if math.isfinite(v)], [v for v in mx if math.isfinite(v)]
    out["cpu_freq_mhz"] = sum(cur) / len(cur) / 1000.0 if cur else NAN
    out["cpu_freq_max_mhz"] = max(mx) / 1000.0 if mx else NAN
    return out


def _gpu_fields(stats: Mapping[str, Any], gpu: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"gpu_percent": to_float(stats.get("GPU"))}
    first = next(iter(gpu.values()), None) if isinstance(gpu, Mapping) else None
    out["gpu_freq_mhz"] = to_float(_get(first, "freq", "cur")) / 1000.0
    out["gpu_freq_max_mhz"] = to_float(_get(first, "freq", "max")) / 1000.0
    if not math.isfinite(out["gpu_percent"]):
        out["gpu_percent"] = to_float(_get(first, "status", "load"))
    return out


def parse_jtop(
    stats: Mapping[str, Any],
    cpu: Any = None,
    gpu: Any = None,
    memory: Any = None,
) -> dict[str, Any]:
    """ResourceSample fields from jtop 4.x `stats` (+ optional cpu/gpu/memory structures)."""
    if not isinstance(stats, Mapping):
        raise ValueError(f"jtop stats must be a mapping, got {type(stats).__name__}")
    out = _cpu_fields(stats, cpu)
    out.update(_gpu_fields(stats, gpu))
    out["cpu_temp_c"] = _temp(stats, "cpu")
    out["gpu_temp_c"] = _temp(stats, "gpu")
    out["power_w"] = to_float(stats.get("Power TOT")) / 1000.0
    tot_kb = to_float(_get(memory, "RAM", "tot"))
    used_kb = to_float(_get(memory, "RAM", "used"))
    ram_frac = to_float(stats.get("RAM"))
    out["mem_total_mb"] = tot_kb / 1024.0
    out["mem_used_mb"] = used_kb / 1024.0 if math.isfinite(used_kb) else ram_frac * tot_kb / 1024
    out["gpu_mem_used_mb"] = to_float(_get(memory, "RAM", "shared")) / 1024.0
    return out


class JtopSource:
    """Live jtop reader; `jetson` may be an already started jtop object."""

    name = "jtop"

    def __init__(self, jetson: Any = None, interval_s: float = 0.5) -> None:
        self.reason = ""
        self._owned = jetson is None
        self._jetson = jetson
        if jetson is not None:
            return
        try:
            from jtop import jtop  # type: ignore[import-not-found]
        except ImportError:
            self.reason = "unavailable: jtop (jetson-stats) is not installed"
            return
        try:
            self._jetson = jtop(interval=interval_s)
            self._jetson.start()
        except Exception as exc:  # JtopException: service not running, permissions, ...
            self._jetson = None
            self.reason = f"unavailable: jtop service: {exc}"

    def read(self) -> dict[str, Any]:
        j = self._jetson
        if j is None:
            return {}
        return parse_jtop(j.stats, cpu=getattr(j, "cpu", None), gpu=getattr(j, "gpu", None),
                          memory=getattr(j, "memory", None))

    def describe(self) -> SourceStatus:
        if self._jetson is None:
            return SourceStatus(self.name, False, self.reason)
        return SourceStatus(self.name, True, "ok: jtop 4.x stats")

    def close(self) -> None:
        if self._jetson is not None and self._owned:
            try:
                self._jetson.close()
            except Exception:  # service already gone
                pass
        self._jetson = None
        self.reason = self.reason or "unavailable: closed"

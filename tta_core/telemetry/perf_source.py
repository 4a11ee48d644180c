"""perf_event source: last-level-cache hit rate from hardware counters.

Uses the perf_event_open(2) syscall through ctypes (no `perf` subprocess). Counts
PERF_COUNT_HW_CACHE_REFERENCES and PERF_COUNT_HW_CACHE_MISSES (the kernel maps them to LLC
accesses/misses on x86 and ARM) either system-wide (one counter pair per CPU; needs root,
CAP_PERFMON or perf_event_paranoid <= 0) or for one process and the threads it spawns.
Hit rate over the interval since the previous read = 1 - d(misses) / d(references).
When the kernel refuses (no PMU in a VM, paranoid level, seccomp) the source reports
"unavailable: <reason>" and yields no field.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from pathlib import Path
from typing import Any

from tta_core.telemetry.sample import NAN, SourceStatus

PERF_TYPE_HARDWARE = 0
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_HW_CACHE_REFERENCES = 2
PERF_COUNT_HW_CACHE_MISSES = 3
PERF_COUNT_SW_TASK_CLOCK = 1

_SYSCALL_NR = {"x86_64": 298, "amd64": 298, "aarch64": 241, "arm64": 241}
_ATTR_SIZE = 112  # PERF_ATTR_SIZE_VER5: accepted by every kernel since 4.1
_FLAG_INHERIT = 1 << 1
_FLAG_EXCLUDE_HV = 1 << 6


class PerfUnavailable(OSError):
    """perf_event_open refused; `str(exc)` is the human reason."""


def _attr(type_: int, config: int, inherit: bool) -> ctypes.Array:
    buf = bytearray(_ATTR_SIZE)
    struct.pack_into("IIQ", buf, 0, type_, _ATTR_SIZE, config)
    flags = _FLAG_EXCLUDE_HV | (_FLAG_INHERIT if inherit else 0)  # enabled from the start
    struct.pack_into("Q", buf, 40, flags)  # after type,size,config,period,sample_type,fmt
    return ctypes.create_string_buffer(bytes(buf), _ATTR_SIZE)


def _paranoid(proc_root: str | Path = "/proc") -> str:
    try:
        return Path(proc_root, "sys/kernel/perf_event_paranoid").read_text().strip()
    except OSError:
        return "?"


def explain_errno(err: int, paranoid: str) -> str:
    """Human reason for a perf_event_open failure, ending with the errno name."""
    name = errno.errorcode.get(err, str(err))
    if err in (errno.ENOENT, errno.EOPNOTSUPP, errno.ENODEV):
        why = "the CPU/VM exposes no hardware PMU for cache events"
    elif err in (errno.EACCES, errno.EPERM):
        why = (f"permission denied (perf_event_paranoid={paranoid}; system-wide needs <= 0 "
               "or CAP_PERFMON, or a seccomp filter blocks the syscall)")
    elif err == errno.ENOSYS:
        why = "perf_event_open is not implemented or is blocked by seccomp"
    else:
        why = f"perf_event_open failed: {os.strerror(err)}"
    return f"{why} ({name})"


def open_counter(type_: int, config: int, pid: int, cpu: int, inherit: bool = False) -> int:
    """perf_event_open(attr, pid, cpu, -1, 0) -> fd; PerfUnavailable with a reason on error."""
    nr = _SYSCALL_NR.get(platform.machine().lower())
    if nr is None or not hasattr(os, "sched_getaffinity"):
        raise PerfUnavailable(f"perf_event_open syscall unknown on {platform.machine()} / "
                              f"{platform.system()}")
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(ctypes.c_long(nr), _attr(type_, config, inherit), ctypes.c_int(pid),
                      ctypes.c_int(cpu), ctypes.c_int(-1), ctypes.c_ulong(0))
    if fd < 0:
        raise PerfUnavailable(explain_errno(ctypes.get_errno(), _paranoid()))
    return int(fd)


def read_counter(fd: int) -> int:
    """Current 64-bit count of an open counter."""
    return struct.unpack("Q", os.read(fd, 8))[0]


def cache_hit_rate(d_refs: float, d_misses: float) -> float:
    """1 - misses/references clipped to [0, 1]; NaN when there were no references."""
    if d_refs < 0 or d_misses < 0:
        raise ValueError(f"counter deltas must be >= 0, got refs={d_refs!r} misses={d_misses!r}")
    if d_refs == 0:
        return NAN
    return min(1.0, max(0.0, 1.0 - d_misses / d_refs))


class PerfSource:
    """LLC hit rate; `pid=None` counts system-wide, else that process (+ new threads)."""

    name = "perf"

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.reason = ""
        self._pairs: list[tuple[int, int]] = []
        self._last = (0, 0)
        try:
            self._open()
        except PerfUnavailable as exc:
            self.close()
            self.reason = f"unavailable: {exc}"
        else:
            self._last = self._totals()

    def _open(self) -> None:
        targets = ([(-1, c) for c in sorted(os.sched_getaffinity(0))] if self.pid is None
                   else [(self.pid, -1)])
        for pid, cpu in targets:
            inherit = pid != -1
            refs = open_counter(PERF_TYPE_HARDWARE, PERF_COUNT_HW_CACHE_REFERENCES, pid, cpu,
                                inherit)
            try:
                misses = open_counter(PERF_TYPE_HARDWARE, PERF_COUNT_HW_CACHE_MISSES, pid, cpu,
                                      inherit)
            except PerfUnavailable:
                os.close(refs)
                raise
            self._pairs.append((refs, misses))

    @property
    def available(self) -> bool:
        return bool(self._pairs)

    def _totals(self) -> tuple[int, int]:
        refs = sum(read_counter(r) for r, _ in self._pairs)
        misses = sum(read_counter(m) for _, m in self._pairs)
        return refs, misses

    def read(self) -> dict[str, Any]:
        """Hit rate since the previous read (empty dict when unavailable)."""
        if not self._pairs:
            return {}
        refs, misses = self._totals()
        rate = cache_hit_rate(refs - self._last[0], max(0, misses - self._last[1]))
        self._last = (refs, misses)
        return {"cache_hit_rate": rate}

    def describe(self) -> SourceStatus:
        if not self._pairs:
            return SourceStatus(self.name, False, self.reason)
        scope = "system-wide" if self.pid is None else f"pid {self.pid}"
        return SourceStatus(self.name, True, f"ok: LLC refs/misses, {scope}, "
                                             f"{len(self._pairs)} counter pairs")

    def close(self) -> None:
        if self._pairs and not self.reason:
            self.reason = "unavailable: closed"
        for pair in self._pairs:
            for fd in pair:
                os.close(fd)
        self._pairs = []

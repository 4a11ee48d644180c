"""Offline device calibration for the runtime latency predictor (AdaShadow §3.2).

- f(n): slowdown of a fixed compute workload (torch matmul) with k = 0..3 competing busy
  processes, 1 + f(k) = t_k / t_0, fitted as a line. By default the line goes through the
  origin (f(0) = 0 by definition: no competitor, no slowdown); with as many workload threads
  as cores the round-robin model t_k/t_0 = (cores + k)/cores is exactly such a line.
- freq(T): where cpufreq is exposed, the offline CPU frequency is recorded; at run time the
  predictor divides by the measured frequency, so the DVFS curve is read, not modelled.
- b_ratio = b_cache / b_DRAM bandwidth (= DRAM / cache time per byte, >= 1): best copy
  bandwidth of a buffer that fits in L2 vs one much larger than the last-level cache.
- cache_hit_offline: LLC hit rate during the k = 0 workload when perf_event works, else NaN.
- The offline reference of the runtime expansion model (tta_core.adashadow.expansion): n_off, the
  competing processes psutil sees during the idle k = 0 runs (other load on the machine);
  probe_bw_offline_gbs, the telemetry.BandwidthProbe bandwidth (pi2 where no LLC counters
  exist); threads, the torch threads of the workload (the "share" model's T by default).

Competing processes are started and stopped here (`BusyProcesses`), bounded in time, and
always reaped, also on exceptions and KeyboardInterrupt.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tta_core.adashadow.predictor import Calibration  # re-exported: load_calibration's type
from tta_core.io.strict_json import dumps as json_dumps
from tta_core.telemetry import BandwidthProbe, PerfSource, PsutilSource, SysfsSource
from tta_core.telemetry.caches import cache_sizes

CALIBRATION_SCHEMA = "tta.calibration/1"
BUSY_KINDS = ("compute", "memory")


def _busy_worker(kind: str, max_s: float, parent: int, nbytes: int) -> None:
    """Child body: spin (compute) or stream a big buffer (memory) until deadline/orphaned.

    The child starts its own session so that, with Linux sched_autogroup, it competes like an
    independent service instead of splitting our own session's CPU share.
    """
    if hasattr(os, "setsid"):
        os.setsid()
    deadline = time.monotonic() + max_s
    if kind == "memory":
        src = np.ones(nbytes // 8)
        dst = np.empty_like(src)
        while time.monotonic() < deadline and os.getppid() == parent:
            np.copyto(dst, src)
        return
    while time.monotonic() < deadline and os.getppid() == parent:
        for _ in range(20000):
            pass


class BusyProcesses:
    """Context manager running `n` competing processes of `kind` for at most `max_s` s."""

    def __init__(self, n: int, kind: str = "compute", max_s: float = 120.0,
                 memory_bytes: int = 256 << 20) -> None:
        if n < 0:
            raise ValueError(f"number of busy processes must be >= 0, got {n!r}")
        if kind not in BUSY_KINDS:
            raise ValueError(f"busy kind must be one of {BUSY_KINDS}, got {kind!r}")
        if not max_s > 0:
            raise ValueError(f"max_s must be > 0, got {max_s!r}")
        self.n, self.kind, self.max_s, self.memory_bytes = n, kind, max_s, memory_bytes
        self.procs: list[Any] = []

    def __enter__(self) -> BusyProcesses:
        methods = mp.get_all_start_methods()
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
        try:
            for _ in range(self.n):
                p = ctx.Process(target=_busy_worker, daemon=True,
                                args=(self.kind, self.max_s, os.getpid(), self.memory_bytes))
                p.start()
                self.procs.append(p)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        """Terminate, then kill what is left; reap every child."""
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=2.0)
        self.procs = []

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class CalibrationConfig:
    """What to measure. `quick` settings are for tests (a few seconds)."""

    ks: tuple[int, ...] = (0, 1, 2, 3)
    reps: int = 7  # timed workload runs per k (median)
    rep_ms: float = 120.0  # target duration of one timed run
    settle_s: float = 0.4  # after starting busy processes
    matmul_n: int = 256
    threads: int = 0  # torch threads of the workload; 0 = torch.get_num_threads()
    fit_intercept: bool = False
    bw_time_s: float = 0.25  # per buffer size, best-of repetitions inside
    probe_repeats: int = 8  # BandwidthProbe runs averaged into probe_bw_offline_gbs; 0 = none
    max_s: float = 300.0  # hard bound on the life of busy processes

    def __post_init__(self) -> None:
        if 0 not in self.ks or any(k < 0 for k in self.ks) or len(set(self.ks)) < 2:
            raise ValueError(f"ks must contain 0 and another k >= 0, got {self.ks!r}")
        if self.probe_repeats < 0:
            raise ValueError(f"probe_repeats must be >= 0, got {self.probe_repeats!r}")
        for name in ("reps", "matmul_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")

    @classmethod
    def quick(cls) -> CalibrationConfig:
        return cls(ks=(0, 2), reps=3, rep_ms=40.0, settle_s=0.3, threads=1, bw_time_s=0.08,
                   probe_repeats=3)


@dataclass
class CalibrationReport:
    """The fitted Calibration plus the raw measurements it came from."""

    calibration: Calibration
    ks: list[int]
    times_ms: list[float]  # median workload time per k
    slowdown: list[float]  # t_k / t_0
    threads: int
    bw_cache_gbs: float
    bw_dram_gbs: float
    cache_buffer_bytes: int
    dram_buffer_bytes: int
    temp_offline_c: float
    host: str = field(default_factory=socket.gethostname)
    machine: str = field(default_factory=platform.machine)
    cpu_count: int = field(default_factory=lambda: os.cpu_count() or 1)
    config: dict[str, Any] = field(default_factory=dict)
    workload: str = ""  # the timed computation: the matmul, or the user's model's forward

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        cal = d.pop("calibration")
        return _nan_to_none({"schema": CALIBRATION_SCHEMA, "calibration": cal,
                             "measurements": d})

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json_dumps(self.to_dict(), indent=1) + "\n")


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


def load_calibration(path: str | Path) -> Calibration:
    """Calibration stored by `CalibrationReport.save` (null -> NaN; threads null -> 0).

    Files written before n_off / probe_bw_offline_gbs / threads existed load with their
    defaults (0 competing processes, no probe reference, unknown threads).
    """
    data = json.loads(Path(path).read_text())
    if data.get("schema") != CALIBRATION_SCHEMA:
        raise ValueError(f"{path}: schema {data.get('schema')!r} is not {CALIBRATION_SCHEMA!r}")
    cal: dict[str, Any] = {}
    for k, v in data["calibration"].items():
        if k == "threads":
            cal[k] = 0 if v is None else int(v)
        else:
            cal[k] = float("nan") if v is None else float(v)
    return Calibration(**cal)


def fit_slowdown(ks: Sequence[int], slowdown: Sequence[float],
                 fit_intercept: bool = False) -> tuple[float, float]:
    """Least-squares line f(k) = slope*k + intercept to y_k = slowdown_k - 1."""
    k = np.asarray(ks, dtype=np.float64)
    y = np.asarray(slowdown, dtype=np.float64) - 1.0
    if k.shape != y.shape or k.size < 2 or not np.all(np.isfinite(y)):
        raise ValueError(f"need >= 2 finite (k, slowdown) pairs, got {list(ks)}, {list(slowdown)}")
    if fit_intercept:
        slope, intercept = np.polyfit(k, y, 1)
        return float(slope), float(intercept)
    if not np.any(k):
        raise ValueError(f"a fit through the origin needs some k > 0, got {list(ks)}")
    return float(k @ y / (k @ k)), 0.0


class _Workload:
    """A fixed computation repeated `iters` times; `run()` returns its wall time in ms: a
    torch matmul, or `fn` (one call of it; `Model.forward_fn`: the user's model's no-grad
    forward on a batch, so f(n) is the slowdown of the model adaptation serves)."""

    def __init__(self, n: int, threads: int, rep_ms: float,
                 fn: Callable[[], object] | None = None) -> None:
        import torch

        self.torch = torch
        self.threads = threads or torch.get_num_threads()
        if fn is None:
            gen = torch.Generator().manual_seed(0)
            a = torch.randn(n, n, generator=gen)
            b = torch.randn(n, n, generator=gen) / math.sqrt(n)
            c = torch.empty(n, n)

            def fn() -> object:
                return torch.mm(a, b, out=c)
        self.fn = fn
        self.iters = 1
        one = min(self._timed() for _ in range(3))
        self.iters = max(1, round(rep_ms / max(one, 1e-3)))

    def _timed(self) -> float:
        prev = self.torch.get_num_threads()
        self.torch.set_num_threads(self.threads)
        try:
            t0 = time.perf_counter()
            for _ in range(self.iters):  # same inputs every time: no drift into denormals
                self.fn()
            return (time.perf_counter() - t0) * 1e3
        finally:
            self.torch.set_num_threads(prev)

    def run(self) -> float:
        return self._timed()


def forward_fn(model: Any, x: Any) -> Callable[[], object]:
    """One no-grad eval forward of `model` on `x`: the calibration workload of a user's
    model (`tta calibrate --model-card`)."""
    import torch

    model.eval()

    def fn() -> object:
        with torch.no_grad():
            return model(x)

    return fn


def copy_bandwidth_gbs(nbytes: int, seconds: float) -> float:
    """Best observed copy bandwidth (read + write bytes / s, in GB/s) of an nbytes buffer."""
    src = np.ones(max(1, nbytes // 8))
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best, end = 0.0, time.perf_counter() + seconds
    inner = max(1, (1 << 24) // max(nbytes, 1))  # amortise timer overhead for small buffers
    while time.perf_counter() < end or best == 0.0:
        t0 = time.perf_counter()
        for _ in range(inner):
            np.copyto(dst, src)
        dt = time.perf_counter() - t0
        best = max(best, 2 * src.nbytes * inner / dt / 1e9)
    return best


def measure_bandwidth(seconds: float) -> tuple[float, float, int, int]:
    """(b_cache, b_DRAM, cache buffer bytes, DRAM buffer bytes)."""
    l2, llc = cache_sizes()
    small = max(16 << 10, l2 // 4)  # src + dst fit in half of L2
    big = min(max(4 * llc, 64 << 20), 512 << 20)
    return copy_bandwidth_gbs(small, seconds), copy_bandwidth_gbs(big, seconds), small, big


def _offline_state() -> tuple[float, float]:
    """(CPU MHz, CPU degC) from sysfs, NaN where not exposed."""
    got = SysfsSource().read()
    return got["cpu_freq_mhz"], got["cpu_temp_c"]


def _time_k(work: _Workload, k: int, cfg: CalibrationConfig) -> float:
    with BusyProcesses(k, "compute", cfg.max_s):
        if k:
            time.sleep(cfg.settle_s)
        return statistics.median(work.run() for _ in range(cfg.reps))


def _time_idle(work: _Workload, cfg: CalibrationConfig) -> tuple[float, float]:
    """(k = 0 time, competing processes psutil saw meanwhile: NaN if unknown).

    Our own pid and children are excluded (the resource monitor likewise excludes itself).
    """
    window = 0.25
    src = PsutilSource(proc_interval_s=window)
    t0 = time.monotonic()
    t = _time_k(work, 0, cfg)
    time.sleep(max(0.0, window + 0.01 - (time.monotonic() - t0)))
    try:
        n = float(src.read()["competing_processes"])
    except Exception:  # telemetry must not fail the calibration
        n = float("nan")
    return t, n


def probe_bandwidth(repeats: int) -> float:
    """Mean of `repeats` BandwidthProbe runs in GB/s (NaN for 0 repeats)."""
    if repeats < 1:
        return float("nan")
    probe = BandwidthProbe()
    return statistics.fmean(probe.measure() for _ in range(repeats))


def _hit_rate_idle(work: _Workload) -> float:
    src = PerfSource(pid=os.getpid())
    try:
        work.run()
        return float(src.read().get("cache_hit_rate", float("nan")))
    finally:
        src.close()


def calibrate(cfg: CalibrationConfig | None = None,
              progress: Callable[[str], None] | None = None,
              workload: Callable[[], object] | None = None,
              workload_name: str = "") -> CalibrationReport:
    """Measure f(n), b_ratio, offline frequency and hit rate; see the module docstring.
    `workload` (e.g. `forward_fn` of the user's model, named `workload_name` in the
    report) replaces the matmul as the timed computation."""
    cfg = cfg or CalibrationConfig()
    step = progress or (lambda _msg: None)
    work = _Workload(cfg.matmul_n, cfg.threads, cfg.rep_ms, workload)
    freq, temp = _offline_state()
    hit = _hit_rate_idle(work)
    step("probe")
    times = []
    n_off = float("nan")
    for k in sorted(cfg.ks):
        if k == 0:
            t, n_off = _time_idle(work, cfg)
        else:
            t = _time_k(work, k, cfg)
        times.append(t)
        step(f"k={k}")
    times[0] = min(times[0], _time_k(work, 0, cfg))  # idle baseline again: others' load drifts
    step("k=0 again")
    slowdown = [t / times[0] for t in times]
    slope, intercept = fit_slowdown(sorted(cfg.ks), slowdown, cfg.fit_intercept)
    b_cache, b_dram, small, big = measure_bandwidth(cfg.bw_time_s)
    probe_bw = probe_bandwidth(cfg.probe_repeats)
    step("bandwidth")
    cal = Calibration(f_slope=slope, f_intercept=intercept, b_ratio=b_cache / b_dram,
                      freq_offline_mhz=freq, cache_hit_offline=hit, n_off=n_off,
                      probe_bw_offline_gbs=probe_bw, threads=int(work.threads))
    return CalibrationReport(
        calibration=cal, ks=sorted(cfg.ks), times_ms=times, slowdown=slowdown,
        threads=work.threads, bw_cache_gbs=b_cache, bw_dram_gbs=b_dram,
        cache_buffer_bytes=small, dram_buffer_bytes=big, temp_offline_c=temp,
        config=asdict(cfg),
        workload=workload_name or (f"matmul {cfg.matmul_n}x{cfg.matmul_n}" if workload is None
                                   else "a caller's function"),
    )


def n_steps(cfg: CalibrationConfig) -> int:
    """Number of `progress` calls `calibrate(cfg)` makes (for a progress bar)."""
    return len(cfg.ks) + 3

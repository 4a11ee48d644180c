"""Runtime expansion factors of the latency predictor: pi1 (compute) and pi2 (memory).

One job: a ResourceSample -> (pi1, pi2) relative to the offline reference, i.e. what the
machine looked like when the offline profile was measured (`OfflineReference`; the product
takes it from the `tta calibrate` JSON, `tta predictor-bench` from its own profiling run).
predictor.runtime_times then scales the offline per-unit times by Eq. 4. The resource
monitor (telemetry.TelemetrySampler) and `tta predictor-bench` both call
`ExpansionModel.evaluate`, so the bench measures exactly the product's predictor.

Models (`ExpansionModel.model`):
- "share" (default): round-robin sharing stretches a unit's whole time, not only its compute
  share (a descheduled process neither computes nor loads), so the sharing factor
  s(n) = max(1, (n + T) / C) / max(1, (n_off + T) / C) (T torch threads of the adapting
  process, C cores: flat until the cores are full, linear n / C beyond) multiplies both:
  pi1 = freq ratio * s(n), pi2 = s(n) * memory expansion. Under competing processes it
  predicts the backward closer than the paper's linear f(n) (`tta predictor-bench`).
- "paper": AdaShadow §3.2, pi1 = freq ratio * (1 + f(n)) / (1 + f(n_off)) with the linear
  f of `tta calibrate`, pi2 = the memory expansion. With n_off = 0 and f through the origin
  (the default fit) this is predictor.compute_expansion / memory_expansion unchanged.

Memory expansion (both models): the hit-rate formula (predictor.memory_expansion) when the
LLC hit rate is measured; else, with pi2_mode "probe", b_off / b_now of the DRAM copy
bandwidth probe (telemetry.BandwidthProbe) when one was measured; else 1.

Unknown telemetry (NaN, out of range) degrades to factor 1 and never raises; a bad
configuration raises ValueError naming the value.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tta_core.adashadow.predictor import Calibration, compute_expansion, memory_expansion

if TYPE_CHECKING:
    from tta_core.telemetry.sample import ResourceSample

MODELS = ("share", "paper")
PI2_MODES = ("probe", "perf")
NAN = float("nan")


def _known_positive(v: float) -> bool:
    return math.isfinite(v) and v > 0


@dataclass(frozen=True)
class OfflineReference:
    """The machine state the offline profile was measured in (NaN = unknown).

    competing: competing processes n_off (NaN counts as 0); freq_mhz: CPU frequency;
    cache_hit_rate: LLC hit rate; probe_bw_gbs: BandwidthProbe copy bandwidth.
    """

    competing: float = 0.0
    freq_mhz: float = NAN
    cache_hit_rate: float = NAN
    probe_bw_gbs: float = NAN

    def __post_init__(self) -> None:
        n = self.competing
        if not math.isnan(n) and not (math.isfinite(n) and n >= 0):
            raise ValueError(f"OfflineReference.competing must be >= 0 or NaN, got {n!r}")
        hit = self.cache_hit_rate
        if not math.isnan(hit) and not 0.0 <= hit <= 1.0:
            raise ValueError(f"OfflineReference.cache_hit_rate must be in [0, 1] or NaN: {hit!r}")

    @property
    def n_off(self) -> float:
        """Competing processes of the reference, unknown counted as 0."""
        return self.competing if math.isfinite(self.competing) else 0.0

    @classmethod
    def from_calibration(cls, cal: Calibration) -> OfflineReference:
        """The reference stored by `tta calibrate` (old files: n_off 0, no probe)."""
        return cls(competing=cal.n_off, freq_mhz=cal.freq_offline_mhz,
                   cache_hit_rate=cal.cache_hit_offline, probe_bw_gbs=cal.probe_bw_offline_gbs)


def available_cores() -> int:
    """CPUs this process may run on (its affinity), at least 1."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def round_robin_share(competing: float, ref: OfflineReference, threads: int, cores: int) -> float:
    """Fair-share slowdown max(1, (n + T) / C) / max(1, (n_off + T) / C).

    For T >= C it is the line 1 + n / C through the origin (relative to n_off); for T < C it
    is flat until the cores are full (1 thread on 2 cores: one competitor takes the free
    core and does not slow us, which a line through the origin cannot express).
    """
    if threads < 1 or cores < 1:
        raise ValueError(f"threads and cores must be >= 1, got {threads}, {cores}")
    if not (math.isfinite(competing) and competing >= 0):
        raise ValueError(f"competing processes must be finite and >= 0, got {competing}")
    return max(1.0, (competing + threads) / cores) / max(1.0, (ref.n_off + threads) / cores)


def share_pis(freq_mhz: float, competing: float, pi2_mem: float, ref: OfflineReference,
              threads: int, cores: int) -> tuple[float, float]:
    """(pi1, pi2) of the "share" model: sharing stretches compute and memory time alike."""
    s = round_robin_share(competing, ref, threads, cores)
    freq_ratio = compute_expansion(freq_mhz, 0.0, Calibration(freq_offline_mhz=ref.freq_mhz))
    return freq_ratio * s, s * pi2_mem


def relative_pi1(freq_mhz: float, competing: float, ref: OfflineReference,
                 cal: Calibration) -> float:
    """Paper pi1 relative to the reference: (1 + f(n)) / (1 + f(n_off)) times the frequency
    ratio, f from the Calibration; NaN when the calibrated f makes the reference <= 0."""
    now = compute_expansion(freq_mhz, competing, cal)
    off = compute_expansion(ref.freq_mhz, ref.n_off, cal)
    return now / off if off > 0 else NAN


def estimate_pi2(hit_rate: float, probe_bw: float, ref: OfflineReference, cal: Calibration,
                 mode: str) -> tuple[float, str]:
    """(pi2 before sharing, source): the hit-rate formula when phi is known ("perf"), else
    max(1, b_off / b_now) of the bandwidth probe (mode "probe", both measured), else
    (1, "none"). The probe detects contention; a reading above the reference bandwidth is
    probe noise (idle runs read on both sides of the reference on a shared VM), not a
    machine faster than when it was profiled, so it never lowers pi2 below 1.

    The hit rate is normalised by the reference's hit rate when known, else by the
    calibration's cache_hit_offline.
    """
    if math.isfinite(hit_rate):
        if math.isfinite(ref.cache_hit_rate) and ref.cache_hit_rate != cal.cache_hit_offline:
            cal = replace(cal, cache_hit_offline=ref.cache_hit_rate)
        return memory_expansion(hit_rate, cal), "perf"
    if mode == "probe" and _known_positive(probe_bw) and _known_positive(ref.probe_bw_gbs):
        return max(1.0, ref.probe_bw_gbs / probe_bw), "probe"
    return 1.0, "none"


def _factor(v: float) -> float:
    """A usable expansion factor: finite and > 0, else 1 (unknown = offline)."""
    return float(v) if _known_positive(v) else 1.0


@dataclass(frozen=True)
class Expansion:
    """One evaluation: the factors and how they were obtained (diagnostics, the bench)."""

    pi1: float
    pi2: float
    share: float  # round-robin sharing factor s(n) (computed for both models)
    pi2_mem: float  # memory expansion before sharing
    pi2_source: str  # "perf" | "probe" | "none"
    competing: float  # n used: the telemetry's, or n_off when unknown
    probe_bw_gbs: float = NAN  # the probe bandwidth passed in (NaN: none)


@dataclass
class ExpansionModel:
    """pi1 / pi2 from telemetry relative to `reference` (see the module docstring).

    reference None: from the calibration. threads (torch threads of the adapting process)
    0: the calibration's thread count, 1 when it has none. cores 0: this process's affinity.
    """

    model: str = "share"
    calibration: Calibration = field(default_factory=Calibration)
    reference: OfflineReference | None = None
    threads: int = 0
    cores: int = 0
    pi2_mode: str = "probe"

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"expansion model must be one of {MODELS}, got {self.model!r}")
        if self.pi2_mode not in PI2_MODES:
            raise ValueError(f"pi2_mode must be one of {PI2_MODES}, got {self.pi2_mode!r}")
        if not isinstance(self.calibration, Calibration):
            raise ValueError(f"calibration must be a Calibration, got {self.calibration!r}")
        for name in ("threads", "cores"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 1 (0 = default), got {v!r}")
        if self.reference is None:
            self.reference = OfflineReference.from_calibration(self.calibration)
        self.threads = self.threads or self.calibration.threads or 1
        self.cores = self.cores or available_cores()

    def evaluate(self, sample: ResourceSample, probe_bw_gbs: float = NAN) -> Expansion:
        """Factors for one sample; unknown or invalid readings count as the reference's."""
        cal = self.calibration
        ref = self.reference or OfflineReference.from_calibration(cal)  # set by __post_init__
        n = sample.competing_processes
        n = float(n) if math.isfinite(n) and n >= 0 else ref.n_off
        hit = sample.cache_hit_rate
        hit = float(hit) if 0.0 <= hit <= 1.0 else NAN  # NaN fails the test too
        pi2_mem, source = estimate_pi2(hit, probe_bw_gbs, ref, cal, self.pi2_mode)
        pi2_mem = _factor(pi2_mem)
        share = round_robin_share(n, ref, self.threads, self.cores)
        if self.model == "share":
            pi1, pi2 = share_pis(sample.cpu_freq_mhz, n, pi2_mem, ref, self.threads, self.cores)
        else:
            pi1, pi2 = relative_pi1(sample.cpu_freq_mhz, n, ref, cal), pi2_mem
        return Expansion(pi1=_factor(pi1), pi2=_factor(pi2), share=share, pi2_mem=pi2_mem,
                         pi2_source=source, competing=n, probe_bw_gbs=float(probe_bw_gbs))

    def pis(self, sample: ResourceSample, probe_bw_gbs: float = NAN) -> tuple[float, float]:
        """(pi1, pi2) for one sample (`evaluate` without the details)."""
        ex = self.evaluate(sample, probe_bw_gbs)
        return ex.pi1, ex.pi2

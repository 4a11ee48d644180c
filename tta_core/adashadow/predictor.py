"""Runtime layer latency predictor of AdaShadow §3.2.

Offline, each unit's times (weight gradient w, input gradient x, reforward r) are measured
once per model x device x batch size and stored as a `UnitProfile` JSON file. At run time
they are scaled by Eq. 4:

    t_l = (pi1 * eta_l / (eta_l + 1) + pi2 / (eta_l + 1)) * t_l_off

with eta_l = compute time / memory time of the unit, pi1 the computation expansion
(DVFS frequency drop and round-robin sharing with n competing processes) and pi2 the
memory expansion (cache misses paying DRAM instead of cache bandwidth).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tta_core.io.strict_json import dumps as json_dumps

PROFILE_SCHEMA = "tta.unit_profile/1"


@dataclass
class UnitProfile:
    """Offline per-unit latencies (ms) of one model on one device at one batch size."""

    model: str
    device: str
    batch_size: int
    input_shape: tuple[int, ...]
    unit_names: list[str]
    w_ms: np.ndarray
    x_ms: np.ndarray
    r_ms: np.ndarray
    eta: np.ndarray
    forward_ms: float
    # per-unit times of a forward that records the autograd graph (the engine's forward
    # above its floor, the predictor bench's forward); r_ms is the reforward, under no_grad.
    # Profiles without it (older files, MAC estimates) use r_ms.
    g_ms: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.input_shape = tuple(int(v) for v in self.input_shape)
        self.unit_names = [str(n) for n in self.unit_names]
        n = len(self.unit_names)
        if self.g_ms is None:
            self.g_ms = np.array(self.r_ms, dtype=np.float64, copy=True)
        for name in ("w_ms", "x_ms", "r_ms", "eta", "g_ms"):
            arr = np.asarray(getattr(self, name), dtype=np.float64)
            if arr.shape != (n,):
                raise ValueError(f"UnitProfile.{name} has shape {arr.shape}, expected ({n},)")
            if not np.all(np.isfinite(arr)) or np.any(arr < 0):
                raise ValueError(f"UnitProfile.{name} must be finite and >= 0: {arr}")
            setattr(self, name, arr)
        if not (math.isfinite(self.forward_ms) and self.forward_ms >= 0):
            raise ValueError(f"UnitProfile.forward_ms must be finite and >= 0: {self.forward_ms}")
        if self.batch_size < 1:
            raise ValueError(f"UnitProfile.batch_size must be >= 1, got {self.batch_size}")

    def to_dict(self) -> dict:
        """JSON-ready dictionary, tagged with the schema version."""
        return {
            "schema": PROFILE_SCHEMA,
            "model": self.model,
            "device": self.device,
            "batch_size": int(self.batch_size),
            "input_shape": list(self.input_shape),
            "unit_names": list(self.unit_names),
            "w_ms": self.w_ms.tolist(),
            "x_ms": self.x_ms.tolist(),
            "r_ms": self.r_ms.tolist(),
            "eta": self.eta.tolist(),
            "forward_ms": float(self.forward_ms),
            "g_ms": np.asarray(self.g_ms).tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> UnitProfile:
        """Inverse of `to_dict`; rejects another schema version."""
        schema = data.get("schema")
        if schema != PROFILE_SCHEMA:
            raise ValueError(f"unit profile schema {schema!r} is not {PROFILE_SCHEMA!r}")
        fields = {k: v for k, v in data.items() if k != "schema"}
        return cls(**fields)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON (parent folders are created)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json_dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> UnitProfile:
        """Read a profile written by `save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    def check_units(self, unit_names: Sequence[str]) -> None:
        """Raise ValueError unless the profile was made for exactly these units, in order."""
        names = list(unit_names)
        if names == self.unit_names:
            return
        if len(names) != len(self.unit_names):
            raise ValueError(
                f"profile of {self.model!r} has {len(self.unit_names)} units, model has "
                f"{len(names)}: profile made for another model?"
            )
        i = next(k for k, (a, b) in enumerate(zip(names, self.unit_names, strict=True)) if a != b)
        raise ValueError(
            f"profile unit {i} is {self.unit_names[i]!r}, model unit {i} is {names[i]!r}"
        )


@dataclass
class Calibration:
    """Offline device constants: f(n) = f_slope*n + f_intercept, b_ratio = b_DRAM / b_cache.

    b_ratio > 1 means a miss costs more than a hit (DRAM access time / cache access time).
    The offline reference of the runtime expansion (tta_core.adashadow.expansion) is stored too:
    freq_offline_mhz, cache_hit_offline, n_off (competing processes seen while calibrating;
    NaN = unknown, counted as 0), probe_bw_offline_gbs (telemetry.BandwidthProbe bandwidth
    at calibration; NaN = not measured) and threads (torch threads of the calibration
    workload; 0 = unknown).
    """

    f_slope: float = 0.0
    f_intercept: float = 0.0
    b_ratio: float = 1.0
    freq_offline_mhz: float = float("nan")
    cache_hit_offline: float = float("nan")
    n_off: float = 0.0
    probe_bw_offline_gbs: float = float("nan")
    threads: int = 0

    def __post_init__(self) -> None:
        for name in ("f_slope", "f_intercept", "b_ratio"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"Calibration.{name} must be finite, got {getattr(self, name)}")
        if self.b_ratio <= 0:
            raise ValueError(f"Calibration.b_ratio must be > 0, got {self.b_ratio}")
        hit = self.cache_hit_offline
        if not math.isnan(hit) and not 0.0 <= hit <= 1.0:
            raise ValueError(f"Calibration.cache_hit_offline must be in [0, 1] or NaN: {hit}")
        if not math.isnan(self.n_off) and not (math.isfinite(self.n_off) and self.n_off >= 0):
            raise ValueError(f"Calibration.n_off must be finite and >= 0 or NaN: {self.n_off}")
        bw = self.probe_bw_offline_gbs
        if not math.isnan(bw) and not (math.isfinite(bw) and bw > 0):
            raise ValueError(f"Calibration.probe_bw_offline_gbs must be > 0 or NaN: {bw}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) \
                or self.threads < 0:
            raise ValueError(f"Calibration.threads must be an int >= 0, got {self.threads!r}")


def _known_positive(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def compute_expansion(freq_now_mhz: float | None, competing: float, cal: Calibration) -> float:
    """pi1 = freq_off / freq_now * (1 + f(n)); an unknown frequency gives ratio 1.

    `competing` is the number n of competing processes; NaN (unknown) counts as 0.
    """
    if math.isnan(competing):
        competing = 0.0
    if not (math.isfinite(competing) and competing >= 0):
        raise ValueError(f"competing processes must be finite and >= 0, got {competing}")
    ratio = 1.0
    if _known_positive(freq_now_mhz) and _known_positive(cal.freq_offline_mhz):
        ratio = cal.freq_offline_mhz / float(freq_now_mhz)  # type: ignore[arg-type]
    return ratio * (1.0 + cal.f_slope * competing + cal.f_intercept)


def _miss_cost(phi: float, b_ratio: float) -> float:
    return phi + (1.0 - phi) * b_ratio


def memory_expansion(cache_hit_rate: float | None, cal: Calibration) -> float:
    """pi2 from the cache hit rate phi; 1 at the offline hit rate.

    The paper writes pi2 = phi + (1 - phi) * b_DRAM/b_cache, which is the memory time
    relative to an ideal always-hit cache. The offline profile already contains the misses
    of the offline run, so we read pi2 as that expression normalised by its value at the
    offline hit rate: offline conditions give pi2 = 1 exactly, a lower hit rate > 1.
    Unknown (NaN/None) phi -> 1; unknown offline hit rate -> the paper's unnormalised form.
    """
    if cache_hit_rate is None or math.isnan(cache_hit_rate):
        return 1.0
    if not 0.0 <= cache_hit_rate <= 1.0:
        raise ValueError(f"cache_hit_rate must be in [0, 1], got {cache_hit_rate}")
    now = _miss_cost(cache_hit_rate, cal.b_ratio)
    if math.isnan(cal.cache_hit_offline):
        return now
    return now / _miss_cost(cal.cache_hit_offline, cal.b_ratio)


def _check_pi(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return float(value)


def scale_factors(eta: np.ndarray, pi1: float, pi2: float) -> np.ndarray:
    """Per-unit factor of Eq. 4: pi1 * eta/(eta+1) + pi2/(eta+1)."""
    pi1, pi2 = _check_pi("pi1", pi1), _check_pi("pi2", pi2)
    eta = np.asarray(eta, dtype=np.float64)
    return (pi1 * eta + pi2) / (eta + 1.0)


def runtime_times(
    profile: UnitProfile, pi1: float, pi2: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runtime (w, x, r) in ms: the offline times scaled by Eq. 4."""
    k = scale_factors(profile.eta, pi1, pi2)
    return k * profile.w_ms, k * profile.x_ms, k * profile.r_ms


#: forward feedback modes of planning_times (see feedback_pis)
FEEDBACK_MODES = ("off", "uniform", "memory")


def forward_reference(profile: UnitProfile, grad_from: int = 0) -> np.ndarray:
    """Offline per-unit times of a forward that records the autograd graph from unit
    `grad_from` on (0: everywhere, len(units): nowhere), what a measured forward is
    compared with: skipping the graph below the floor makes the engine's forward faster,
    which must not read as a faster machine."""
    n = len(profile.unit_names)
    if isinstance(grad_from, bool) or not 0 <= int(grad_from) <= n:
        raise ValueError(f"grad_from must be a unit index in [0, {n}], got {grad_from!r}")
    return np.where(np.arange(n) >= int(grad_from), profile.g_ms, profile.r_ms)


def feedback_pis(profile: UnitProfile, pi1: float, pi2: float, forward_ms: float,
                 mode: str, grad_from: int = 0) -> tuple[float, float]:
    """(pi1, pi2) corrected by the forward measured on this batch, a forward that recorded
    the autograd graph from unit `grad_from` on (forward_reference).

    "uniform": both scaled by measured / predicted forward (every unit slows alike).
    "memory": pi1 is the telemetry's (trusted), pi2 is re-solved so that Eq. 4 predicts
    exactly the measured forward: the forward is a memory-contention probe on our own
    workload. Units then slow by their own eta, so a backward more memory-bound than the
    forward slows more than it (ResNet-50's top units), one less memory-bound slows less
    (the small net's). The solved pi2 only ever raises the telemetry's pi2: a forward
    faster than the telemetry predicts falls back to "uniform". Use "memory" only with a
    live telemetry pi1: with pi1 = 1 standing for "unknown", unseen compute sharing would
    be read as memory contention.
    "off", or a forward that is not finite and > 0: (pi1, pi2) unchanged.
    """
    if mode not in FEEDBACK_MODES:
        raise ValueError(f"feedback mode must be one of {FEEDBACK_MODES}, got {mode!r}")
    pi1, pi2 = _check_pi("pi1", pi1), _check_pi("pi2", pi2)
    if mode == "off" or not (math.isfinite(forward_ms) and forward_ms > 0):
        return pi1, pi2
    eta = np.asarray(profile.eta, dtype=np.float64)
    r = forward_reference(profile, grad_from)
    comp, mem = float(np.sum(r * eta / (eta + 1.0))), float(np.sum(r / (eta + 1.0)))
    predicted = pi1 * comp + pi2 * mem
    if not (math.isfinite(predicted) and predicted > 0):
        raise ValueError(f"predicted reforward times must sum to > 0, got {predicted!r}")
    if mode == "memory" and mem > 0:
        solved = (forward_ms - pi1 * comp) / mem
        if solved >= pi2:
            return pi1, solved
    k = forward_ms / predicted
    return pi1 * k, pi2 * k


def planning_times(profile: UnitProfile, pi1: float, pi2: float, forward_ms: float,
                   feedback: str = "uniform", grad_from: int = 0,
                   backward_factor: float = 1.0,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (w, x, r) the planner uses: Eq. 4 runtime times at the telemetry's (pi1, pi2)
    corrected by the measured forward (feedback_pis), w and x then by the measured
    backwards of past plans (`backward_factor`, backward_feedback.BackwardFeedback). One
    function for the engine and the ROS scheduler, so both plan with the same predictor."""
    k = _check_pi("backward_factor", backward_factor)
    w, x, r = runtime_times(profile, *feedback_pis(profile, pi1, pi2, forward_ms, feedback,
                                                   grad_from))
    return k * w, k * x, r


def eta_from_macs(
    macs: np.ndarray | float,
    bytes_moved: np.ndarray | float,
    flops_per_s: float,
    cache_bytes_per_s: float,
) -> np.ndarray:
    """eta = c*delta_c / (m*delta_m) with delta_c = 1/F and delta_m = 1/b_cache (§3.2).

    `flops_per_s` is the MAC rate F used for delta_c (the same unit as `macs`). Every unit
    reads its weights and activations, so bytes_moved must be > 0.
    """
    if not (flops_per_s > 0 and cache_bytes_per_s > 0):
        raise ValueError(
            f"flops_per_s and cache_bytes_per_s must be > 0, got {flops_per_s}, "
            f"{cache_bytes_per_s}"
        )
    c = np.asarray(macs, dtype=np.float64)
    m = np.asarray(bytes_moved, dtype=np.float64)
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"macs must be finite and >= 0, got {c}")
    if not np.all(np.isfinite(m)) or np.any(m <= 0):
        raise ValueError(f"bytes_moved must be finite and > 0, got {m}")
    return (c / flops_per_s) / (m / cache_bytes_per_s)

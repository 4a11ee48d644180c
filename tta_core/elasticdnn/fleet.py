"""Several cameras, one computer (ElasticDNN §III-C): choose each pipeline's size.

N perception pipelines ("apps") share one processor. App i runs at `hz` frames per second in
batches of `batch_size`, must finish a batch within `deadline_ms`, and can serve C sizes
(shares of filters kept, `keep`); each size has a forward time per batch (`forward_ms`, on
the whole processor) and an accuracy estimate. A plan picks one size per app so that

    maximise   sum_i accuracy_i(size_i)
    subject to forward_ms_i(size_i) <= deadline_ms_i                     for every app
               sum_i hz_i / batch_size_i * forward_ms_i(size_i) / 1000 <= capacity

(`capacity` in processor-seconds per second: 1.0 = the whole processor). That is the
default objective, `Objective("confidence")`. `Objective("paper", t_max_s)` maximises
instead the paper's Eq. 8 over a retraining window t_max: app i at size j is retrained in
T_ij seconds with all of the retraining resource, gets the share lambda_i = s_i / sum_a s_a
of it (Eq. 10, s the kept share `keep`), so it retrains for tau_i = T_ij / lambda_i, which
must fit the window (Eq. 11); its accuracy over the window is A_ij while it retrains and
Ã_ij after (`window_accuracy`; A, Ã from tta_core.elasticdnn.accuracy_estimate, Eq. 5-7);
the serving limits above still hold. Eq. 8 as printed weights A by (t_max - tau) and Ã by
tau, which would reward retraining slowly; the text (accuracy averaged over the window,
before and after retraining, after Ekya) is followed instead: A for tau, Ã for the rest.
The retraining resource is its own (the paper's lambda: a share of the device given to
retraining), separate from the serving capacity. The paper solves Eq. 8-11 by evolutionary
search; the space is tiny (8 sizes ^ 4 apps = 4,096) so `plan_fleet` enumerates every
combination (C^N <= MAX_COMBINATIONS, vectorised) and is exact under either objective.
Ties: the larger objective, then the smaller load, then the first in product order.
When nothing fits, every app gets its smallest size (least keep) and the plan says
why (`feasible` False, `reason`), instead of raising.

`equal_split` is the baseline (the paper's "Uniform"): each app owns capacity / N and takes
the largest size that fits its share and its deadline.

Accuracy proxy (a deviation from the paper, stated): the paper's estimator is a small
network trained on labelled accuracies and corrected with accuracies monitored online,
which needs labels a robot does not have. Here a size's accuracy is estimated label-free
as the mean max-softmax confidence of recent frames at that size, mapped to accuracy by a
monotone `ConfidenceCalibration` fitted offline on labelled source data (clean and
corrupted batches: (mean confidence, accuracy) pairs, isotonic regression). `SizeProxy`
keeps the per-size estimate online (EMA of batch confidences per size); a size not seen
yet takes the nearest observed size's estimate shifted by the source accuracy gap between
the two sizes (a prior measured offline), or, without a prior, the observed estimates
interpolated over `keep`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_COMBINATIONS = 10_000  # C^N above this: ValueError (exhaustive search only)
_EPS = 1e-9  # slack of the capacity check (float sums)


@dataclass(frozen=True)
class AppOption:
    """One pipeline at one size: share of filters kept, forward ms per batch on the whole
    processor, estimated accuracy (label-free proxy, 0..1). For the paper's objective also
    the accuracy after retraining (Ã; NaN: no gain) and the retraining time with all of
    the retraining resource (T, seconds)."""

    keep: float
    forward_ms: float
    accuracy: float
    accuracy_after: float = math.nan
    retrain_s: float = 0.0

    @property
    def after(self) -> float:
        """Ã, the accuracy once retrained (the accuracy itself when not given)."""
        return self.accuracy if math.isnan(self.accuracy_after) else self.accuracy_after


@dataclass
class App:
    """One perception pipeline: its frame rate, batch deadline and size options."""

    name: str
    hz: float
    deadline_ms: float
    options: list[AppOption]
    batch_size: int = 1  # forward_ms is per batch of this many frames

    def load(self, option: AppOption) -> float:
        """Processor-seconds per second this app needs at `option`."""
        return self.hz / self.batch_size * option.forward_ms / 1000.0

    def check(self) -> None:
        """One-line ValueError naming the first bad value."""
        for what, v in (("hz", self.hz), ("deadline_ms", self.deadline_ms)):
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"app {self.name!r}: {what} must be a finite number > 0, "
                                 f"got {v!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"app {self.name!r}: batch_size must be an integer >= 1, "
                             f"got {self.batch_size!r}")
        if not self.options:
            raise ValueError(f"app {self.name!r} has no size options")
        for o in self.options:
            if not (math.isfinite(o.forward_ms) and o.forward_ms >= 0):
                raise ValueError(f"app {self.name!r}: forward_ms of keep={o.keep:g} must be "
                                 f"a finite number >= 0, got {o.forward_ms!r}")
            if not (math.isfinite(o.accuracy) and math.isfinite(o.after)):
                raise ValueError(f"app {self.name!r}: accuracy of keep={o.keep:g} is not "
                                 f"finite ({o.accuracy!r}, after retraining {o.after!r})")
            if not (math.isfinite(o.retrain_s) and o.retrain_s >= 0):
                raise ValueError(f"app {self.name!r}: retrain_s of keep={o.keep:g} must be "
                                 f"a finite number >= 0, got {o.retrain_s!r}")
            if not 0 < o.keep <= 1:
                raise ValueError(f"app {self.name!r}: keep={o.keep!r} outside (0, 1]")


@dataclass(frozen=True, eq=False)
class FleetPlan(Mapping[str, float]):
    """The chosen size (keep) per app name; reads like a dict {name: keep}.

    `feasible` False: no combination meets every deadline within the capacity; `sizes`
    are then each app's smallest size and `reason` says what did not fit."""

    sizes: dict[str, float]
    feasible: bool
    accuracy: float  # the objective's value: sum of accuracy estimates (paper: over t_max)
    load: float  # sum of the chosen options' loads (processor-seconds per second)
    reason: str = ""
    combinations: int = 0  # how many were enumerated
    shares: dict[str, float] = field(default_factory=dict)  # each app's load / capacity
    retrain_shares: dict[str, float] = field(default_factory=dict)  # Eq. 10 (paper only)

    def __getitem__(self, name: str) -> float:
        return self.sizes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]


def check_fleet(apps: Sequence[App], capacity: float) -> int:
    """Validate the instance; returns the number of combinations C_1 * ... * C_N."""
    if not (isinstance(capacity, int | float) and math.isfinite(capacity) and capacity > 0):
        raise ValueError(f"capacity must be a finite number > 0, got {capacity!r}")
    if not apps:
        raise ValueError("no apps to plan for")
    names = [a.name for a in apps]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"app name {dup!r} appears twice")
    for a in apps:
        a.check()
    return math.prod(len(a.options) for a in apps)


def _smallest(app: App) -> AppOption:
    """The smallest size (least keep; ties: the shorter forward)."""
    return min(app.options, key=lambda o: (o.keep, o.forward_ms))


def _plan(apps: Sequence[App], chosen: Sequence[AppOption], capacity: float, feasible: bool,
          reason: str = "", combinations: int = 0, objective: Objective | None = None
          ) -> FleetPlan:
    loads = [a.load(o) for a, o in zip(apps, chosen, strict=True)]
    value, shares = float(sum(o.accuracy for o in chosen)), {}
    if objective is not None and objective.kind == "paper":
        lam = retrain_shares([o.keep for o in chosen])
        value = sum(window_accuracy(o, x, objective.t_max_s)
                    for o, x in zip(chosen, lam, strict=True))
        shares = {a.name: x for a, x in zip(apps, lam, strict=True)}
    return FleetPlan({a.name: o.keep for a, o in zip(apps, chosen, strict=True)}, feasible,
                     float(value), float(sum(loads)), reason, combinations,
                     {a.name: ld / capacity for a, ld in zip(apps, loads, strict=True)},
                     shares)


def _infeasible(apps: Sequence[App], capacity: float, combinations: int,
                objective: Objective | None = None, serving_ok: bool = False) -> FleetPlan:
    """Every app at its smallest size, with the reason nothing fits."""
    chosen = [_smallest(a) for a in apps]
    late = [a for a, o in zip(apps, chosen, strict=True) if o.forward_ms > a.deadline_ms]
    need = sum(a.load(o) for a, o in zip(apps, chosen, strict=True))
    if serving_ok and objective is not None and objective.kind == "paper":
        reason = (f"no combination that serves in time also retrains every app within "
                  f"t_max {objective.t_max_s:g} s (Eq. 11)")
    elif late:
        a = late[0]
        reason = (f"app {a.name!r}: no size meets its deadline {a.deadline_ms:g} ms "
                  f"(smallest forward {_smallest(a).forward_ms:g} ms)")
    else:
        reason = f"even the smallest sizes need load {need:.4g} > capacity {capacity:.4g}"
    return _plan(apps, chosen, capacity, False, reason, combinations, objective)


@dataclass(frozen=True)
class Objective:
    """What a plan maximises. "confidence": the sum of the options' accuracy estimates.
    "paper": Eq. 8 over the retraining window `t_max_s`, per app the mean accuracy over
    the window (`window_accuracy`), with the retraining shares of Eq. 10 and the window
    limit of Eq. 11 as constraints (module docstring)."""

    kind: str = "confidence"
    t_max_s: float = math.nan

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise ValueError(f"objective {self.kind!r} is not one of {OBJECTIVES}")
        if self.kind == "paper" and not (math.isfinite(self.t_max_s) and self.t_max_s > 0):
            raise ValueError(f"the paper objective needs a retraining window t_max_s > 0, "
                             f"got {self.t_max_s!r}")


OBJECTIVES = ("confidence", "paper")


def retrain_shares(keeps: Sequence[float]) -> list[float]:
    """Eq. 10: each app's share of the retraining resource, lambda_i = s_i / sum_a s_a."""
    total = float(sum(keeps))
    return [float(k) / total for k in keeps]


def window_accuracy(option: AppOption, share: float, t_max_s: float) -> float:
    """One app's term of Eq. 8 divided by t_max: retraining takes tau = T / lambda
    (Eq. 8, 11), served at A meanwhile and at Ã for the rest of the window:
    (A * tau + Ã * (t_max - tau)) / t_max, tau capped at t_max."""
    frac = min(option.retrain_s / share / t_max_s, 1.0)
    return option.accuracy * frac + option.after * (1.0 - frac)


def _along(values: Sequence[float], i: int, k: int) -> np.ndarray:
    """`values` shaped to broadcast along axis i of k."""
    shape = [1] * k
    shape[i] = len(values)
    return np.asarray(values, dtype=np.float64).reshape(shape)


def _serving_grid(apps: Sequence[App], capacity: float
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per combination: sum of accuracies, total load, deadlines and capacity kept."""
    k = len(apps)
    acc = np.zeros([len(a.options) for a in apps])
    load = np.zeros_like(acc)
    ok = np.ones(acc.shape, dtype=bool)
    for i, a in enumerate(apps):
        acc = acc + _along([o.accuracy for o in a.options], i, k)
        load = load + _along([a.load(o) for o in a.options], i, k)
        ok = ok & _along([o.forward_ms <= a.deadline_ms for o in a.options], i, k).astype(bool)
    return acc, load, ok & (load <= capacity * (1 + _EPS) + _EPS)


def _paper_grid(apps: Sequence[App], t_max_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Per combination: Eq. 8 / t_max (with Eq. 10's shares) and Eq. 11 kept."""
    k = len(apps)
    shape = [len(a.options) for a in apps]
    total = np.zeros(shape)
    for i, a in enumerate(apps):  # Eq. 10's denominator, sum of the chosen ratios
        total = total + _along([o.keep for o in a.options], i, k)
    value, ok = np.zeros(shape), np.ones(shape, dtype=bool)
    for i, a in enumerate(apps):
        tau = _along([o.retrain_s / o.keep for o in a.options], i, k) * total  # T / lambda
        ok &= tau <= t_max_s * (1 + _EPS) + _EPS  # Eq. 11
        frac = np.minimum(tau / t_max_s, 1.0)
        value = value + _along([o.accuracy for o in a.options], i, k) * frac \
            + _along([o.after for o in a.options], i, k) * (1.0 - frac)
    return value, ok


def plan_fleet(apps: Sequence[App], capacity: float = 1.0,
               objective: Objective | None = None) -> FleetPlan:
    """The exact best size per app (module docstring) under `objective` (default: the
    confidence sum); ValueError when C^N exceeds MAX_COMBINATIONS; infeasible instances:
    smallest sizes, `feasible` False."""
    n = check_fleet(apps, capacity)
    if n > MAX_COMBINATIONS:
        raise ValueError(f"{n} size combinations ({' x '.join(str(len(a.options)) for a in apps)})"
                         f" exceed the exhaustive search limit {MAX_COMBINATIONS}")
    objective = objective or Objective()
    acc, load, ok = _serving_grid(apps, capacity)
    serving_ok = bool(ok.any())
    if objective.kind == "paper":
        acc, retrain_ok = _paper_grid(apps, objective.t_max_s)
        ok &= retrain_ok
    if not ok.any():
        return _infeasible(apps, capacity, n, objective, serving_ok)
    flat = np.flatnonzero(ok.ravel())
    a_ok = acc.ravel()[flat]
    best = a_ok.max()
    tied = flat[a_ok >= best - 1e-12 * max(1.0, abs(best))]
    pick = tied[np.argmin(load.ravel()[tied])]  # argmin: the first of equal loads
    idx = np.unravel_index(pick, acc.shape)
    chosen = [a.options[int(j)] for a, j in zip(apps, idx, strict=True)]
    return _plan(apps, chosen, capacity, True, "", n, objective)


def equal_split(apps: Sequence[App], capacity: float = 1.0) -> FleetPlan:
    """Baseline: each app owns capacity / N and takes its largest size (keep) whose load
    fits that share and whose forward meets its deadline; an app with none takes its
    smallest size and the plan is flagged infeasible."""
    check_fleet(apps, capacity)
    share = capacity / len(apps)
    chosen, missing = [], []
    for a in apps:
        fits = [o for o in a.options if o.forward_ms <= a.deadline_ms
                and a.load(o) <= share * (1 + _EPS) + _EPS]
        if fits:
            chosen.append(max(fits, key=lambda o: (o.keep, -o.forward_ms)))
        else:
            chosen.append(_smallest(a))
            missing.append(a.name)
    reason = (f"no size of {', '.join(map(repr, missing))} fits a 1/{len(apps)} share "
              f"({share:.4g}) and its deadline" if missing else "")
    return _plan(apps, chosen, capacity, not missing, reason, len(apps))


# ---------------------------------------------------------------- label-free accuracy proxy
def mean_confidence(logits: Any) -> float:
    """Mean max-softmax probability of a batch of logits (N, K) (torch or numpy)."""
    z = np.asarray(logits.detach().float().cpu() if hasattr(logits, "detach") else logits,
                   dtype=np.float64)
    if z.ndim != 2 or z.shape[0] == 0:
        raise ValueError(f"logits must be a non-empty (N, K) array, got shape {z.shape}")
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    return float((p.max(axis=1) / p.sum(axis=1)).mean())


def _isotonic(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least-squares non-decreasing fit of y over sorted x (pool adjacent
    violators), as one knot per pooled block: (weighted mean x, fitted y)."""
    blocks: list[list[float]] = []  # [sum w*x, sum w*y, sum w]
    for xi, yi, wi in zip(x, y, w, strict=True):
        blocks.append([float(wi * xi), float(wi * yi), float(wi)])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]:
            last = blocks.pop()
            blocks[-1] = [a + b for a, b in zip(blocks[-1], last, strict=True)]
    b = np.array(blocks)
    return b[:, 0] / b[:, 2], b[:, 1] / b[:, 2]


@dataclass(frozen=True)
class ConfidenceCalibration:
    """Monotone map mean confidence -> accuracy: piecewise linear through the knots,
    constant beyond them. `identity()`: the confidence itself (uncalibrated)."""

    confidence: tuple[float, ...] = (0.0, 1.0)
    accuracy: tuple[float, ...] = (0.0, 1.0)

    def __post_init__(self) -> None:
        c, a = np.asarray(self.confidence, float), np.asarray(self.accuracy, float)
        if c.ndim != 1 or c.size == 0 or c.shape != a.shape:
            raise ValueError(f"calibration needs equally many knots, got {c.size} confidences "
                             f"and {a.size} accuracies")
        if not (np.isfinite(c).all() and np.isfinite(a).all()):
            raise ValueError("calibration knots must be finite")
        if np.any(np.diff(c) < 0) or np.any(np.diff(a) < 0):
            raise ValueError("calibration knots must be non-decreasing in both columns")

    def __call__(self, confidence: float) -> float:
        return float(np.interp(confidence, self.confidence, self.accuracy))

    @classmethod
    def identity(cls) -> ConfidenceCalibration:
        return cls()

    @classmethod
    def fit(cls, confidences: Sequence[float], accuracies: Sequence[float],
            weights: Sequence[float] | None = None) -> ConfidenceCalibration:
        """Isotonic regression of accuracy on confidence over labelled batches (one pair
        per batch, e.g. the source set clean and corrupted); one knot per pooled block at
        its mean confidence, so the map rises between blocks instead of in steps (fewer
        artificial ties between sizes)."""
        c = np.asarray(confidences, float)
        a = np.asarray(accuracies, float)
        w = np.ones_like(c) if weights is None else np.asarray(weights, float)
        if c.size == 0 or c.shape != a.shape or c.shape != w.shape:
            raise ValueError(f"fit needs equally many confidences ({c.size}), accuracies "
                             f"({a.size}) and weights ({w.size}), at least one")
        if np.any(w <= 0) or not (np.isfinite(c).all() and np.isfinite(a).all()):
            raise ValueError("fit needs finite confidences and accuracies, weights > 0")
        order = np.argsort(c, kind="stable")
        knots, fitted = _isotonic(c[order], a[order], w[order])
        return cls(tuple(float(v) for v in knots), tuple(float(v) for v in fitted))

    def to_dict(self) -> dict[str, list[float]]:
        return {"confidence": list(self.confidence), "accuracy": list(self.accuracy)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ConfidenceCalibration:
        try:
            return cls(tuple(map(float, d["confidence"])), tuple(map(float, d["accuracy"])))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"calibration needs lists 'confidence' and 'accuracy': {exc}") \
                from None


class SizeProxy:
    """Per-size accuracy estimate of one pipeline from the confidences of its batches:
    EMA (weight `alpha`) of the mean confidence per size, mapped by the calibration.

    A size not observed yet: with a `prior` (source accuracy per size, measured offline),
    the estimate of the nearest observed size shifted by the prior's gap between the two
    sizes (the domain moves every size alike); without one, the observed estimates
    interpolated over keep (constant beyond). Nothing observed yet: NaN."""

    def __init__(self, sizes: Sequence[float], calibration: ConfidenceCalibration | None = None,
                 alpha: float = 0.2, prior: Mapping[float, float] | None = None) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.sizes = tuple(sorted(float(s) for s in sizes))
        self.calibration = calibration or ConfidenceCalibration.identity()
        self.alpha = float(alpha)
        self.prior = {float(k): float(v) for k, v in (prior or {}).items()}
        self.confidence: dict[float, float] = {}

    def observe(self, keep: float, confidence: float) -> None:
        """One batch served (or probed) at `keep` had this mean confidence."""
        if not math.isfinite(confidence):
            return
        k = min(self.sizes, key=lambda s: abs(s - keep)) if self.sizes else float(keep)
        old = self.confidence.get(k)
        self.confidence[k] = confidence if old is None else \
            (1 - self.alpha) * old + self.alpha * confidence

    def _unseen(self, size: float, est: Mapping[float, float]) -> float:
        with_prior = [k for k in est if k in self.prior]
        if size in self.prior and with_prior:
            k = min(with_prior, key=lambda k: (abs(k - size), -k))
            return float(np.clip(est[k] + self.prior[size] - self.prior[k], 0.0, 1.0))
        seen = sorted(est)
        return float(np.interp(size, seen, [est[k] for k in seen]))

    def accuracy(self) -> dict[float, float]:
        """keep -> estimated accuracy, for every size."""
        est = {k: self.calibration(c) for k, c in self.confidence.items()}
        if not est:
            return {s: math.nan for s in self.sizes}
        return {s: est[s] if s in est else self._unseen(s, est) for s in self.sizes}

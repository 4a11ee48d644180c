"""Accuracy of a new domain from the past domains' accuracies (ElasticDNN §III-C1, Eq. 5-7).

For every model size j the scheduler needs two numbers on the current target domain k: the
accuracy before retraining, A_j, and after, Ã_j. The paper first predicts them (a small
fully connected network on the remodeling ratio, the source-target distance and the mean
feature vectors) and then calibrates the prediction with the accuracies monitored on the
k - 1 domains seen before, weighted by how close each is to domain k:

    sigma_1..sigma_{k-1} = softmax(1 / dis_{k,1}, ..., 1 / dis_{k,k-1})          (Eq. 5)
    A_j   <- A_j / 2 + sum_a sigma_a * rA_j^(a) / 2                               (Eq. 6)
    Ã_j   <- Ã_j / 2 + sum_a sigma_a * r̃A_j^(a) / 2                              (Eq. 7)

rA^(a) / r̃A^(a) are the accuracies monitored on past domain a before / after its
retraining (one row per size, or a matrix per application and size: any trailing shape).
The distance dis_{k,a} is the Euclidean distance between the domains' representations
(mean feature vectors), as the paper's "domain representation". A past domain at distance
0 has an infinite inverse: the softmax's limit, equal weight on the domains at distance 0
and none elsewhere, is used.

The initial prediction (the paper's trained network) needs labelled accuracies per domain
to train; `AccuracyHistory.estimate` takes it as input instead. A label-free stand-in used
by the fleet benchmark: the confidence proxy before retraining (tta_core.elasticdnn.fleet)
and, after, that proxy plus the past domains' weighted retraining gain (`gain_prior`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["AccuracyHistory", "PastDomain", "calibrate", "distance_weights",
           "domain_distance"]


def distance_weights(distances: Sequence[float]) -> np.ndarray:
    """Eq. 5: softmax of the inverse distances to the past domains; ValueError naming a
    distance that is negative or not finite, or an empty list."""
    d = np.asarray(distances, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"distances must be a non-empty list, got shape {d.shape}")
    bad = d[~(np.isfinite(d) & (d >= 0))]
    if bad.size:
        raise ValueError(f"domain distance {bad[0]!r} must be finite and >= 0")
    zero = d == 0
    if zero.any():  # 1/0 = inf: the softmax's limit
        return zero / zero.sum()
    z = 1.0 / d
    e = np.exp(z - z.max())
    return e / e.sum()


def calibrate(initial: np.ndarray | Sequence[float], past: np.ndarray | Sequence,
              distances: Sequence[float]) -> np.ndarray:
    """Eq. 6 (before retraining) or Eq. 7 (after): initial / 2 + sum_a sigma_a past[a] / 2,
    sigma from Eq. 5. `past` has one entry per past domain, each shaped like `initial`;
    no past domain (k = 1): the initial prediction unchanged."""
    init = np.asarray(initial, dtype=np.float64)
    if len(distances) == 0:
        return init.copy()
    p = np.asarray(past, dtype=np.float64)
    if p.shape != (len(distances), *init.shape):
        raise ValueError(f"past accuracies have shape {p.shape}, expected "
                         f"{(len(distances), *init.shape)} (one per past domain)")
    sigma = distance_weights(distances)
    return 0.5 * init + 0.5 * np.tensordot(sigma, p, axes=1)


def domain_distance(a: np.ndarray | Sequence[float], b: np.ndarray | Sequence[float]) -> float:
    """Euclidean distance between two domain representations (mean feature vectors)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"domain representations differ in shape: {x.shape} vs {y.shape}")
    return float(np.linalg.norm(x - y))


@dataclass(frozen=True)
class PastDomain:
    """A seen domain: its representation and the accuracy per size monitored before and
    after its retraining (rA, r̃A; arrays of one shape)."""

    representation: np.ndarray
    before: np.ndarray
    after: np.ndarray


@dataclass
class AccuracyHistory:
    """The past domains, and the Eq. 5-7 estimate of a new one."""

    domains: list[PastDomain] = field(default_factory=list)

    def record(self, representation: Sequence[float], before: Sequence[float],
               after: Sequence[float]) -> None:
        """Domain k is done: keep its representation and monitored accuracies."""
        b, a = np.asarray(before, dtype=np.float64), np.asarray(after, dtype=np.float64)
        if b.shape != a.shape or not (np.isfinite(b).all() and np.isfinite(a).all()):
            raise ValueError(f"monitored accuracies must be finite and of one shape, got "
                             f"{b.shape} before and {a.shape} after")
        self.domains.append(PastDomain(np.asarray(representation, dtype=np.float64), b, a))

    def distances(self, representation: Sequence[float]) -> list[float]:
        """dis_{k,a} to every past domain a."""
        return [domain_distance(representation, d.representation) for d in self.domains]

    def weights(self, representation: Sequence[float]) -> np.ndarray:
        """Eq. 5's sigma over the past domains (empty without any)."""
        if not self.domains:
            return np.zeros(0)
        return distance_weights(self.distances(representation))

    def gain_prior(self, representation: Sequence[float]) -> np.ndarray | float:
        """The past domains' retraining gain r̃A - rA, weighted by Eq. 5 (0 without any): a
        label-free stand-in for the initial prediction of Ã (module docstring)."""
        if not self.domains:
            return 0.0
        gain = np.stack([d.after - d.before for d in self.domains])
        return np.tensordot(self.weights(representation), gain, axes=1)

    def estimate(self, representation: Sequence[float], before: Sequence[float],
                 after: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
        """(A, Ã) of the new domain: the initial predictions `before`, `after` calibrated
        by Eq. 6 and Eq. 7."""
        dist = self.distances(representation)
        past_b = [d.before for d in self.domains]
        past_a = [d.after for d in self.domains]
        out_b, out_a = calibrate(before, past_b, dist), calibrate(after, past_a, dist)
        if not (np.isfinite(out_b).all() and np.isfinite(out_a).all()):
            raise ValueError(f"accuracy estimate is not finite ({out_b}, {out_a})")
        return out_b, out_a

    def label_free(self, representation: Sequence[float], proxy: Sequence[float]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """(A, Ã) of the new domain from a label-free proxy per size (module docstring):
        initial A the proxy, initial Ã the proxy plus the past domains' weighted
        retraining gain (clipped to [0, 1]), both calibrated by Eq. 6-7. NaN arrays when
        there is no past domain or the proxy or representation is not finite (unknown)."""
        a0 = np.asarray(proxy, dtype=np.float64)
        rep = np.asarray(representation, dtype=np.float64)
        if not (self.domains and np.isfinite(a0).all() and np.isfinite(rep).all()):
            return np.full(a0.shape, np.nan), np.full(a0.shape, np.nan)
        return self.estimate(rep, a0, np.clip(a0 + self.gain_prior(rep), 0.0, 1.0))

    @classmethod
    def from_records(cls, records: Sequence[Mapping[str, Any]], sizes: Sequence[float]
                     ) -> AccuracyHistory:
        """Past domains from JSON records {"representation": [...], "before": {keep: acc},
        "after": {keep: acc}} (a fleet_calibration file's "past"), each size of `sizes` in
        that order; ValueError naming a record that lacks one."""
        h = cls()
        for i, r in enumerate(records):
            try:
                b, a = ({float(k): float(v) for k, v in r[key].items()}
                        for key in ("before", "after"))
                h.record(r["representation"], [b[float(k)] for k in sizes],
                         [a[float(k)] for k in sizes])
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                raise ValueError(f"past domain {i}: needs 'representation' and 'before' / "
                                 f"'after' accuracies for sizes {list(sizes)} ({exc!r})"
                                 ) from None
        return h

    def to_records(self, sizes: Sequence[float]) -> list[dict[str, Any]]:
        """The past domains as `from_records` reads them (arrays in `sizes` order)."""
        return [{"representation": d.representation.tolist(),
                 "before": {str(float(k)): float(v) for k, v in zip(sizes, d.before,
                                                                    strict=True)},
                 "after": {str(float(k)): float(v) for k, v in zip(sizes, d.after,
                                                                   strict=True)}}
                for d in self.domains]

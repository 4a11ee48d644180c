"""The known domains' statistics: centroid, spread and prior spread per domain.

A domain j keeps, per embedding dimension, the exponentially weighted mean c_j (the
centroid) and variance S_j of its batches' embeddings (exact running values for the first
1/alpha batches), and W_j, the mean of its batches' *within-batch* spreads: the variance
over a batch's samples of the per-sample features divided by the batch size, i.e. what
the batch-to-batch spread would be if batches were i.i.d. draws of the domain. W is known
from a domain's first batch, so a young domain is judged with its own scale instead of
other domains' (the spread of one dimension differs by far between corruptions, so a
pooled scale made every young blur domain look novel and split it).

The distance of an embedding e to domain j is a standardised Euclidean one,

    d_j = sqrt(mean_i (e_i - c_ji)^2 / (V_ji (1 + 1/n_j))),
    V_j = (n_j S_j + n0 W_j) / (n_j + n0),

about 1 within a domain (1 + 1/n_j: the uncertainty of a centroid from n_j batches);
n0 = `prior_weight`, n_j capped at 1/alpha. Without within-batch spreads (pooled
moments) W_j is replaced by the pooled S of all domains.
"""

from __future__ import annotations

import torch
from torch import Tensor

F64 = torch.float64


class DomainTable:
    """Per-domain arrays (rows in creation order) and the distance to them."""

    FIELDS = ("centroids", "spreads", "within")

    def __init__(self, dim: int, alpha: float, prior_weight: float, within_scale: float,
                 var_floor: float) -> None:
        if dim < 1:
            raise ValueError(f"embedding dim must be >= 1, got {dim}")
        self.dim, self.alpha = int(dim), float(alpha)
        self.prior_weight, self.within_scale = float(prior_weight), float(within_scale)
        self.var_floor = float(var_floor)
        self.names: list[str] = []
        self.centroids = torch.zeros(0, self.dim, dtype=F64)
        self.spreads = torch.zeros(0, self.dim, dtype=F64)
        self.within = torch.zeros(0, self.dim, dtype=F64)
        self._counts: list[float] = []  # batches per domain, on the host (no read to branch)
        self.last_used = torch.zeros(0, dtype=torch.int64)

    @property
    def counts(self) -> Tensor:
        """Batches absorbed per domain (float64)."""
        return torch.tensor(self._counts, dtype=F64)

    @counts.setter
    def counts(self, value: Tensor) -> None:
        self._counts = [float(c) for c in value.tolist()]

    def count(self, j: int) -> float:
        """Batches absorbed by domain j."""
        return self._counts[j]

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        """Row of domain `name`; ValueError naming it when unknown."""
        if name not in self.names:
            raise ValueError(f"unknown domain {name!r}; known: {self.names}")
        return self.names.index(name)

    def add(self, name: str, now: int) -> int:
        """Append an empty domain; returns its row."""
        if name in self.names:
            raise ValueError(f"domain {name!r} exists already")
        self.names.append(name)
        z = torch.zeros(1, self.dim, dtype=F64)
        for f in self.FIELDS:
            setattr(self, f, torch.cat([getattr(self, f), z]))
        self._counts.append(0.0)
        self.last_used = torch.cat([self.last_used, torch.tensor([now])])
        return len(self.names) - 1

    def remove(self, j: int) -> str:
        """Drop row j; returns its name."""
        keep = [i for i in range(len(self.names)) if i != j]
        for f in (*self.FIELDS, "last_used"):
            setattr(self, f, getattr(self, f)[keep])
        self._counts.pop(j)
        return self.names.pop(j)

    def absorb(self, j: int, e: Tensor, within: Tensor | None, now: int) -> None:
        """EW mean/variance update of domain j with e (exact running mean while young)."""
        n = self._counts[j]
        w = max(1.0 / (n + 1.0), self.alpha)
        delta = e - self.centroids[j]
        self.centroids[j] += w * delta
        self.spreads[j] = (1.0 - w) * (self.spreads[j] + w * delta * delta)
        if within is not None:
            self.within[j] += w * (within - self.within[j])
        self._counts[j] = n + 1.0
        self.last_used[j] = now

    def pooled_spread(self) -> Tensor | None:
        """S of all domains with >= 2 batches, weighted by (capped) count; None if none."""
        if all(c <= 1.0 for c in self._counts):  # every weight below is 0
            return None
        w = (self.counts - 1).clamp(min=0, max=1.0 / self.alpha)
        return (w[:, None] * self.spreads).sum(0) / w.sum()

    def variances(self) -> Tensor:
        """V_j per domain (rows), floored at var_floor."""
        pool = self.pooled_spread()
        if pool is None:
            pool = torch.ones(self.dim, dtype=F64)
        has_within = (self.within > 0).any(1, keepdim=True)
        prior = torch.where(has_within, self.within_scale * self.within, pool[None])
        n = self.counts.clamp(max=1.0 / self.alpha)[:, None]
        n0 = self.prior_weight
        return ((n * self.spreads + n0 * prior) / (n + n0)).clamp_min(self.var_floor)

    def distances(self, e: Tensor) -> Tensor:
        """d_j of e to every domain (empty when none is known). The variance is the
        predictive one of a new batch, V_j (1 + 1/n_j): a centroid from few batches is
        itself uncertain (without this, young domains split on their third batch)."""
        if not self.names:
            return torch.zeros(0, dtype=F64)
        v = self.variances() * (1.0 + 1.0 / self.counts.clamp(min=1.0))[:, None]
        return ((e[None] - self.centroids) ** 2 / v).mean(1).sqrt()

    def pair_distance(self, a: Tensor, wa: Tensor | None, b: Tensor, wb: Tensor | None
                      ) -> float:
        """Distance between two batches, standardised by their within-batch spreads (the
        pooled spread when a batch has none): about 1 or less for the same domain."""
        return float(self.pair_distances(a, wa, b, wb))

    def pair_distances(self, a: Tensor, wa: Tensor | None, b: Tensor, wb: Tensor | None
                       ) -> Tensor:
        """`pair_distance` as a 0-dim tensor (not read back)."""
        pool = self.pooled_spread()
        fallback = pool if pool is not None else torch.ones(self.dim, dtype=F64)
        v = (fallback if wa is None else wa) + (fallback if wb is None else wb)
        return ((a - b) ** 2 / v.clamp_min(self.var_floor)).mean().sqrt()

    def lru(self, exclude: int) -> int:
        """Row of the least recently used domain other than `exclude`."""
        order = torch.argsort(self.last_used, stable=True).tolist()
        return next(i for i in order if i != exclude)

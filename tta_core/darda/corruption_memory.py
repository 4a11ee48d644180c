"""DARDA's corruption-aware memory bank (§4.4, Algorithm 1) and the Eq. 15 trigger (§4.5).

N slots, N / |Y| per predicted class. Each sample comes with its corruption projection
C^i (the encoder h's, unit vector); its representativeness is the cosine to the centroid
C_cur of the ongoing corruption. Admission (Algorithm 1 as the text describes it): a
sample whose representativeness reaches `min_similarity` enters when its predicted class
has room; when the class is full it replaces that class's least representative sample if
it is more representative (re-scored against the current centroid, so samples of a
previous corruption leave the bank first after a shift).

`similarity_variance(C_cur)`: the variance of the stored samples' cosines to C_cur; the
context-aware BN refresh (Eq. 15) runs once it drops below phi_thresh ("the samples of the
memory bank become representative of the current corruption").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class _Slot:
    x: Tensor
    proj: Tensor
    sim: float  # float(proj @ centroid) for the memory's current centroid


class CorruptionMemory:
    """Label-balanced memory of samples representative of the ongoing corruption."""

    def __init__(self, capacity: int, num_classes: int, min_similarity: float = 0.0) -> None:
        if capacity < 1 or num_classes < 2:
            raise ValueError(f"memory needs capacity >= 1 and num_classes >= 2, got "
                             f"{capacity}, {num_classes}")
        if not -1.0 <= min_similarity <= 1.0:
            raise ValueError(f"min_similarity {min_similarity} not in [-1, 1]")
        self.capacity, self.num_classes = int(capacity), int(num_classes)
        self.quota = max(1, self.capacity // self.num_classes)
        self.min_similarity = float(min_similarity)
        self.slots: list[list[_Slot]] = [[] for _ in range(self.num_classes)]
        self._scored: Tensor | None = None  # the centroid the slots' `sim` is against

    def __len__(self) -> int:
        return sum(len(s) for s in self.slots)

    def clear(self) -> None:
        """Forget every sample."""
        self.slots = [[] for _ in range(self.num_classes)]

    def add(self, x: Tensor, pred: Tensor, proj: Tensor, centroid: Tensor) -> int:
        """Offer samples x [B, ...] with predicted classes [B] and projections [B, dim]
        against the current centroid [dim] (not modified in place while in use); returns
        how many were stored."""
        return self.add_reading(x, pred, proj, centroid)[0]

    def add_reading(self, x: Tensor, pred: Tensor, proj: Tensor, centroid: Tensor,
                    extra: Tensor | None = None) -> tuple[int, list[float]]:
        """`add`, reading `extra` (a 1-D tensor, e.g. the batch's entropy) to the host in
        the same transfer as the admission's inputs: (stored, extra's values)."""
        if not len(x) == len(pred) == len(proj):
            raise ValueError(f"x, pred and proj lengths differ: {len(x)}, {len(pred)}, "
                             f"{len(proj)}")
        self._rescore(centroid)
        n = len(x)
        kept = [proj[i].detach().clone() for i in range(n)]
        pieces = [(proj @ centroid).double(), pred.double()]
        if kept:  # a kept sample's score, computed as `_rescore` computes it
            pieces.append(torch.stack([p @ centroid for p in kept]).double())
        if extra is not None:
            pieces.append(extra.reshape(-1).double())
        values = torch.cat(pieces).tolist()
        sims, classes, own = values[:n], values[n:2 * n], values[2 * n:3 * n]
        stored = 0
        for i, (cls, sim) in enumerate(zip(classes, sims, strict=True)):
            c = int(cls)
            if sim >= self.min_similarity and self._admit(c, sim):
                self.slots[c].append(_Slot(x[i].detach().clone(), kept[i], own[i]))
                stored += 1
        return stored, values[3 * n:]

    def _rescore(self, centroid: Tensor) -> None:
        """Score every stored sample against `centroid` (one read), unless already."""
        if centroid is self._scored:
            return
        slots = [s for cls in self.slots for s in cls]
        if slots:
            for s, sim in zip(slots, torch.stack([s.proj @ centroid for s in slots])
                              .tolist(), strict=True):
                s.sim = sim
        self._scored = centroid

    def _admit(self, cls: int, sim: float) -> bool:
        """Make room for one sample of class `cls` with representativeness `sim`."""
        own = self.slots[cls]
        if len(own) < self.quota:
            if len(self) >= self.capacity:  # full bank: the fullest class gives one up
                max(self.slots, key=len).pop(0)
            return True
        worst = min(range(len(own)), key=lambda k: own[k].sim)
        if own[worst].sim < sim:
            own.pop(worst)
            return True
        return False

    def retarget(self, centroid: Tensor) -> int:
        """A shift: drop the samples whose cosine to the new centroid is below
        `min_similarity` (they represent the previous corruption, not the ongoing one);
        returns how many were dropped."""
        before = len(self)
        self._rescore(centroid)
        self.slots = [[s for s in cls if s.sim >= self.min_similarity] for cls in self.slots]
        return before - len(self)

    def samples(self) -> Tensor | None:
        """Stored samples as one batch (None when empty)."""
        xs = [s.x for cls in self.slots for s in cls]
        return torch.stack(xs) if xs else None

    def projections(self) -> Tensor | None:
        """Stored projections [n, dim] (None when empty)."""
        ps = [s.proj for cls in self.slots for s in cls]
        return torch.stack(ps) if ps else None

    def mean_projection(self) -> Tensor | None:
        """C_bar of Eq. 16: the mean projection of the stored samples."""
        p = self.projections()
        return None if p is None else p.mean(0)

    def similarity_variance(self, centroid: Tensor) -> float:
        """Variance (population) of the stored samples' cosines to `centroid`; inf when
        fewer than two samples are stored."""
        p = self.projections()
        if p is None or len(p) < 2:
            return float("inf")
        return float((p @ centroid).var(correction=0))

    def class_counts(self) -> list[int]:
        """Stored samples per class."""
        return [len(s) for s in self.slots]

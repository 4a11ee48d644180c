"""Label-balanced memory bank of recent samples (RoTTA's CSTU, Yuan et al. CVPR 2023).

Samples are filed under their predicted class (pseudo-label). A class below its quota
(capacity / classes) takes a new sample, making room in the fullest classes when the bank
is full; a class at its quota only takes it in place of one of its own samples that
scores worse. Score = timeliness + uncertainty, with timeliness 1 / (1 + exp(-age /
capacity)) (old samples go first) and uncertainty = entropy / ln(classes): the
official code's heuristic with lambda_t = lambda_u = 1. DARDA keeps such a bank of the
ongoing corruption's samples and refreshes the BN statistics from it (Eq. 15).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class _Item:
    x: Tensor
    uncertainty: float
    age: int = 0


class BalancedMemory:
    """Category-balanced sampling with timeliness and uncertainty (CSTU)."""

    def __init__(self, capacity: int = 64, num_classes: int = 10) -> None:
        if capacity < 1 or num_classes < 2:
            raise ValueError(f"memory needs capacity >= 1 and num_classes >= 2, got "
                             f"{capacity}, {num_classes}")
        self.capacity, self.num_classes = int(capacity), int(num_classes)
        self.per_class = self.capacity / self.num_classes
        self.data: list[list[_Item]] = [[] for _ in range(self.num_classes)]

    def __len__(self) -> int:
        return sum(len(c) for c in self.data)

    def clear(self) -> None:
        """Forget every sample (e.g. after a domain switch)."""
        self.data = [[] for _ in range(self.num_classes)]

    def score(self, age: int, uncertainty: float) -> float:
        """Higher = evicted first."""
        return 1.0 / (1.0 + math.exp(-age / self.capacity)) + uncertainty

    def add(self, x: Tensor, logits: Tensor) -> int:
        """Offer each sample of batch x with its logits; returns how many were admitted."""
        pred, ent = self.labels(logits)
        values = torch.cat([pred.double(), ent.double()]).tolist()
        n = len(pred)
        return self.admit(x, [int(c) for c in values[:n]], values[n:])

    def labels(self, logits: Tensor) -> tuple[Tensor, Tensor]:
        """(predicted classes, entropies / ln(classes)) of a batch, on its device: what
        `admit` takes once read to the host."""
        logp = torch.log_softmax(logits.detach().float(), dim=1)
        ent = -(logp.exp() * logp).sum(1) / math.log(self.num_classes)
        return logp.argmax(1), ent

    def admit(self, x: Tensor, pred: list[int], uncertainty: list[float]) -> int:
        """Offer each sample of batch x with its predicted class and uncertainty (`labels`,
        on the host); returns how many were admitted."""
        admitted = 0
        for i in range(x.shape[0]):
            cls, u = pred[i], uncertainty[i]
            if self._make_room(cls, self.score(0, u)):
                self.data[cls].append(_Item(x[i].detach().clone(), u))
                admitted += 1
            for items in self.data:
                for it in items:
                    it.age += 1
        return admitted

    def _make_room(self, cls: int, new_score: float) -> bool:
        if len(self.data[cls]) < self.per_class:
            if len(self) < self.capacity:
                return True
            sizes = [len(c) for c in self.data]
            top = max(sizes)
            return self._evict([c for c, n in enumerate(sizes) if n == top], new_score)
        return self._evict([cls], new_score)

    def _evict(self, classes: list[int], new_score: float) -> bool:
        best: tuple[float, int, int] | None = None
        for c in classes:
            for i, it in enumerate(self.data[c]):
                s = self.score(it.age, it.uncertainty)
                if best is None or s >= best[0]:
                    best = (s, c, i)
        if best is None:
            return True
        if best[0] > new_score:
            self.data[best[1]].pop(best[2])
            return True
        return False

    def samples(self) -> Tensor | None:
        """All stored samples as one batch (None when empty)."""
        xs = [it.x for items in self.data for it in items]
        return torch.stack(xs) if xs else None

    def class_counts(self) -> list[int]:
        """Stored samples per class."""
        return [len(c) for c in self.data]

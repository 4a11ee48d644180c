"""Byte bookkeeping of what autograd holds for backward, deduplicated by storage.

A storage saved by reference counts once however many ops save it (a ReLU output saved by
the ReLU and by the next conv is one storage). Identity is the storage's data pointer
confirmed by a live weak reference to the storage: once a storage is freed its address may
be reused by a new one within the same forward, which then counts as new.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from tta_core.memory.scope import ROLES, SaveSite

MIB = 2**20


@dataclass
class SavedBytes:
    """Saved-activation bytes of one forward (what backward will read), measured.

    ``analytic`` is what papers count (SURGEON, Tent-style tables): for every call of a
    conv/linear unit made with grad enabled, its input's elements x element size, summed
    per call without dedup (a block input read by conv1 and the downsample counts twice);
    BN inputs, activation masks, pooling indices and the codec's bitmaps are not in it.
    ``analytic_kept`` is the same with each unit's input scaled by its keep ratio.
    """

    total: int
    per_unit: dict[str, int]
    by_role: dict[str, int]
    analytic: int
    analytic_kept: int
    saves: int  # pack calls on activations (parameters and buffers excluded)
    stored: int  # distinct objects held (storages by reference + encodings)

    @property
    def total_mib(self) -> float:
        """total in MiB."""
        return self.total / MIB


@dataclass(frozen=True)
class SaveEvent:
    """One save as seen by the hooks (for the byte predictor): sizes, role, unit."""

    storage: int  # index of the distinct storage within the forward
    storage_nbytes: int
    view: tuple  # (storage index, offset, shape, stride, version): one tensor view
    numel: int
    elem: int
    role: str
    unit: str
    nonzero: float  # fraction of nonzero entries (wgrad saves only; 1.0 otherwise)
    floating: bool = True  # a floating-point tensor (DAF quantizes only those)
    narrow_elem: int = 0  # integer saves: bytes per entry in the narrowest dtype (0: none)


@dataclass
class Ledger:
    """Accumulates stored bytes per unit and role for one forward."""

    per_unit: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_role: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    saves: int = 0
    stored: int = 0
    _storages: dict[int, tuple[StorageWeakRef, int]] = field(default_factory=dict)
    _next_index: int = 0

    def storage_index(self, t: Tensor, site: SaveSite) -> int:
        """Index of t's storage; counts its bytes the first time the live storage is seen."""
        st = t.untyped_storage()
        ptr = st.data_ptr()
        hit = self._storages.get(ptr)
        if hit is not None and not hit[0].expired():
            return hit[1]
        index = self._next_index
        self._next_index += 1
        self._storages[ptr] = (StorageWeakRef(st), index)
        self.add(st.nbytes(), site)
        return index

    def add(self, nbytes: int, site: SaveSite) -> None:
        """Count a newly stored object of nbytes."""
        self.per_unit[site.unit] += nbytes
        self.by_role[site.role] += nbytes
        self.stored += 1

    def result(self, wgrad_inputs: dict[str, int], keep: dict[str, float]) -> SavedBytes:
        """The SavedBytes of this forward (keep: per-unit keep ratio, missing = 1)."""
        analytic = sum(wgrad_inputs.values())
        kept = sum(round(b * keep.get(u, 1.0)) for u, b in wgrad_inputs.items())
        return SavedBytes(sum(self.per_unit.values()), dict(self.per_unit), dict(self.by_role),
                          analytic, kept, self.saves, self.stored)

    def clear(self) -> None:
        """Drop the storage references (weak) kept for dedup."""
        self._storages.clear()

"""Saved-activation codec: per-unit magnitude pruning of ∂W inputs, exact activation masks.

    codec = ActivationCodec(staged, CodecPlan({"layer1.0.conv1": 0.3}, default=0.5))
    with codec:                       # one batch: the dedup cache lives for one forward
        loss = loss_fn(model(x))
    loss.backward()                   # decoding happens here; the context may be closed
    codec.result                      # SavedBytes actually held (measured)

What autograd saves, and what the codec does with it (sites: tta_core.memory.scope):

- an activation module's saved tensor (ReLU result, ReLU6/Hardtanh result or input): the
  backward only tests lo < x < hi, so it is stored as an exact 1-bit mask (``act_masks``);
- a conv/linear input (read only for ∂W; ∂x needs just the weight): magnitude-pruned to the
  unit's keep ratio, stored as a 1-bit position bitmap + the kept values in memory order;
- everything else (BN inputs: ∂γ and ∂x need them exactly; pooling indices, ...) is held
  by reference, as without the codec. Pruning BN inputs or the masks ruins the gradients.

Dedup: one encoding per (data pointer, shape, stride, _version, encoding), reused only while
the source storage is alive (a weak reference to it): after a storage is freed, the
allocator may hand its address to a new tensor of the same shape within the same forward,
and a pointer-only key would then decode the wrong tensor. The cache is cleared at exit.
The same tensor saved under two encodings (a ReLU output: mask for the ReLU, pruned values
for the next conv) is stored once per encoding.

torch.compile: refused (a clear RuntimeError while tracing; also at exit when tensors were
saved but no unit module's hook ran, as for a compiled module). Compiled graphs save their
own tensors, with no module to attribute them to, so per-unit policies need eager mode.

torch.utils.checkpoint: saved-tensor hooks nest and the innermost pair wins. Inside a
non-reentrant checkpoint region checkpoint's own hooks replace the codec's, so the region's
saves are neither seen nor encoded (they are recomputed in backward, which runs outside the
codec's context); reentrant checkpoint runs its forward under no_grad (nothing saved) and
recomputes in backward. Both compose region by region: the codec compresses what is saved
outside checkpointed regions. Put the codec around the forward only.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from tta_core.memory.accounting import SavedTensorContext
from tta_core.memory.packed import PackedMask, PackedPruned
from tta_core.memory.scope import ACT, WGRAD, SaveSite
from tta_core.model.units import StagedModel

DENSE = "dense"
MASK = "mask"
Encoding = str | float  # DENSE, MASK or a keep ratio in (0, 1)


def _check_keep(unit: str, value: object) -> None:
    if value == DENSE:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
        raise ValueError(f"keep ratio for unit {unit!r} must be in (0, 1] or 'dense', "
                         f"got {value!r}")


@dataclass(frozen=True)
class CodecPlan:
    """Per-unit keep ratios of conv/linear saved inputs ("dense" = 1 = not pruned).

    Units missing from ``keep`` use ``default``. A keep ratio so close to 1 that bitmap +
    values would not be smaller than the dense tensor (>= 1 - 1/(8 * element size)) is
    stored dense. ``act_masks`` stores activation saves as exact 1-bit masks.
    ``sample``: at most this many entries are sampled for each pruning threshold.
    """

    keep: Mapping[str, float | str] = field(default_factory=dict)
    default: float | str = DENSE
    act_masks: bool = True
    sample: int = 65536

    def __post_init__(self) -> None:
        _check_keep("<default>", self.default)
        for unit, value in self.keep.items():
            _check_keep(unit, value)
        if self.sample < 1:
            raise ValueError(f"sample must be >= 1, got {self.sample}")

    @classmethod
    def uniform(cls, keep: float | str, act_masks: bool = True) -> CodecPlan:
        """The same keep ratio for every unit."""
        return cls({}, keep, act_masks)

    def keep_of(self, unit: str) -> float:
        """The unit's keep ratio as a number (dense = 1.0)."""
        value = self.keep.get(unit, self.default)
        return 1.0 if value == DENSE else float(value)

    def encoding(self, role: str, unit: str, elem: int) -> Encoding:
        """How a save of this role, unit and element size is stored."""
        if role == ACT:
            return MASK if self.act_masks else DENSE
        if role == WGRAD:
            keep = self.keep_of(unit)
            return DENSE if keep >= 1.0 - 1.0 / (8 * elem) else keep
        return DENSE


class ActivationCodec(SavedTensorContext):
    """saved_tensors_hooks that store one forward's saves as the plan says (eager only)."""

    def __init__(self, target: StagedModel | nn.Module, plan: CodecPlan) -> None:
        super().__init__(target)
        unknown = sorted(set(plan.keep) - set(self.scope.unit_names))
        if unknown:
            raise ValueError(f"plan names units the model does not have: {unknown[:5]}")
        self.plan = plan
        self._cache: dict[tuple, tuple[StorageWeakRef, object]] = {}

    def _pack(self, t: Tensor, site: SaveSite) -> object:
        enc = self.plan.encoding(site.role, site.unit, t.element_size())
        if enc == DENSE:
            self.ledger.storage_index(t, site)
            return t
        hit = self._lookup(t, enc)
        if hit is not None:
            return hit
        if enc == MASK:
            packed: PackedMask | PackedPruned = PackedMask.encode(t, site.band)
        else:
            packed = PackedPruned.encode(t, float(enc), self.plan.sample)
        self._cache[self._key(t, enc)] = (StorageWeakRef(t.untyped_storage()), packed)
        self.ledger.add(packed.nbytes, site)
        return packed

    @staticmethod
    def _key(t: Tensor, enc: Encoding) -> tuple:
        return (t.data_ptr(), tuple(t.shape), t.stride(), t._version, enc)

    def _lookup(self, t: Tensor, enc: Encoding) -> object | None:
        """The encoding made earlier in this forward of this very tensor, if any."""
        hit = self._cache.get(self._key(t, enc))
        if hit is None or hit[0].expired():
            return None
        return hit[1]

    def _unpack(self, packed: object) -> Tensor:
        if isinstance(packed, PackedMask | PackedPruned):
            return packed.decode()
        return packed  # type: ignore[return-value]

    def _keep_ratios(self) -> dict[str, float]:
        return {u: self.plan.keep_of(u) for u in self.scope.unit_names}

    def _clear_batch(self) -> None:
        self._cache.clear()

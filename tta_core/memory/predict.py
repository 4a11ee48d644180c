"""Predicted saved-activation bytes of a codec plan, from one dense profiling forward.

profile_saves records every save of one forward (sizes, role, unit, storage identity and,
for conv/linear inputs, the fraction of nonzeros); predicted_bytes replays the codec's
decisions (CodecPlan.encoding, the same dedup rules) on it for any plan without running
the model: the planner's memory cost of a plan. A pruned input is predicted to keep
min(keep, nonzero fraction) of its entries (the codec never stores zeros). The profile is
for one input shape and batch size; saves scale ~linearly with the batch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tta_core.memory.accounting import SavedActivationCounter
from tta_core.memory.codec import DENSE, MASK, CodecPlan
from tta_core.memory.ledger import SaveEvent
from tta_core.memory.packed import mask_nbytes, pruned_nbytes
from tta_core.memory.quant import NARROW, Quant, quant_nbytes
from tta_core.model.units import StagedModel


@dataclass
class SaveProfile:
    """Every save of one dense forward, in order."""

    events: list[SaveEvent]
    unit_names: list[str]
    input_shape: tuple[int, ...]  # the whole batch
    unit_kinds: dict[str, str] = field(default_factory=dict)  # for DAF norm-unit widths


@dataclass
class PredictedBytes:
    """Predicted bytes held for backward under a plan: total and per unit."""

    total: int
    per_unit: dict[str, int]


def profile_saves(target: StagedModel | nn.Module, x: Tensor,
                  loss_fn: Callable[[Tensor], Tensor] | None = None) -> SaveProfile:
    """Run one forward of the model on x (and loss_fn on its output) recording every save.

    Grad is enabled; the model's train/eval modes are left as they are (use the modes of
    adaptation). The loss's saves count too (attributed to the last unit), as in adaptation.
    """
    counter = SavedActivationCounter(target, record=True)
    with torch.enable_grad(), counter:
        out = counter.scope.model(x)
        if loss_fn is not None:
            out = loss_fn(out)
    del out
    kinds = {name: kind for name, _m, kind in counter.scope.units}
    return SaveProfile(counter.events, list(counter.scope.unit_names), tuple(x.shape), kinds)


def _encoded_nbytes(e: SaveEvent, enc: str | float | Quant) -> int:
    if enc == MASK:
        return mask_nbytes(e.numel)
    if isinstance(enc, Quant):
        return quant_nbytes(e.numel, enc.bits, enc.group)
    if enc == NARROW:
        return e.numel * e.narrow_elem
    kept = round(min(float(enc), e.nonzero) * e.numel)
    return pruned_nbytes(e.numel, kept, e.elem)


def predicted_bytes(profile: SaveProfile, plan: CodecPlan) -> PredictedBytes:
    """Bytes the codec would hold for this plan (dense storages once, each encoding once)."""
    unknown = sorted((set(plan.keep) | set(plan.bits)) - set(profile.unit_names))
    if unknown:
        raise ValueError(f"plan names units the profile does not have: {unknown[:5]}")
    per_unit: dict[str, int] = defaultdict(int)
    dense: set[int] = set()
    encoded: set[tuple] = set()
    for e in profile.events:
        enc = plan.encoding(e.role, e.unit, e.elem, profile.unit_kinds.get(e.unit, ""),
                            e.numel, e.floating)
        if enc == NARROW and not e.narrow_elem:
            enc = DENSE  # no narrower dtype holds it: the codec keeps it by reference
        if enc == DENSE:
            if e.storage not in dense:
                dense.add(e.storage)
                per_unit[e.unit] += e.storage_nbytes
        elif (e.view, enc) not in encoded:
            encoded.add((e.view, enc))
            per_unit[e.unit] += _encoded_nbytes(e, enc)
    return PredictedBytes(sum(per_unit.values()), dict(per_unit))

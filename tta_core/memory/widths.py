"""Uniform activation widths for a method: the codec plan of `activation_bits`.

daf_plan (DAF's uniform widths, used by tent, SURGEON and AdaShadow): conv/linear units
whose parameters are all frozen store nothing (0 bits: backward never reads their input),
trainable ones store their input at `bits`, BN/LN inputs at `bits`, ReLU masks exact,
max-pool indices in the narrowest integer dtype (lossless). Units given a keep ratio
(SURGEON's pruned units) keep it instead. DAF's budgeted widths are tta_core.daf.plans.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tta_core.memory.codec import CodecPlan
from tta_core.memory.quant import STORED_BITS, check_bits
from tta_core.memory.scope import unit_table
from tta_core.model.units import StagedModel

_WGRAD_KINDS = ("conv", "linear")


def check_activation_bits(bits: object) -> None:
    """A method's activation_bits: 8, 4 or 2 (0 would freeze every unit; not allowed)."""
    check_bits("<activation_bits>", bits, STORED_BITS)


def trainable_units(target: StagedModel | nn.Module) -> tuple[list[str], list[str]]:
    """(trainable, frozen) conv/linear unit names (trainable: any parameter needs grad)."""
    _model, rows = unit_table(target)
    trainable, frozen = [], []
    for name, mod, kind in rows:
        if kind in _WGRAD_KINDS:
            needs = any(p.requires_grad for p in mod.parameters(recurse=False))
            (trainable if needs else frozen).append(name)
    return trainable, frozen


def daf_plan(target: StagedModel | nn.Module, bits: int, group: int = 128,
             keep: Mapping[str, float | str] | None = None, act_masks: bool = True,
             norm_keep: Mapping[str, float] | None = None, pool_inputs: bool = False
             ) -> CodecPlan:
    """Uniform DAF widths: frozen conv/linear inputs dropped, the rest at `bits`; units
    named in `keep` (SURGEON's pruned units) keep their keep ratio instead, norm units in
    `norm_keep` their centred pruning (CodecPlan.norm_keep); `pool_inputs`: max-pool inputs
    not stored."""
    check_activation_bits(bits)
    trainable, frozen = trainable_units(target)
    keep = dict(keep or {})
    widths = {n: bits for n in trainable if n not in keep}
    widths.update(dict.fromkeys(frozen, 0))
    return CodecPlan(keep, "dense", act_masks, bits=widths, norm_bits=bits, group=group,
                     narrow_ints=True, norm_keep=dict(norm_keep or {}),
                     pool_inputs=pool_inputs)

"""DAF plans for the activation codec: uniform widths for a method, and budgeted widths.

daf_plan: the plan of `tent.activation_bits` / `surgeon.activation_bits`: conv/linear units
whose parameters are all frozen store nothing (0 bits: backward never reads their input),
trainable ones store their input at `bits`, BN/LN inputs at `bits`, ReLU masks exact,
max-pool indices in the narrowest integer dtype (lossless).

budget_plan: DAF's budgeted widths (bit_alloc.greedy_bits) for the trainable conv/linear
units from one profiled forward (predict.SaveProfile): each unit's bytes per width are
replayed by the byte predictor; its time per width is `ms_per_elem` * entries stored (the
quantize + dequantize kernels); widths of norm units stay at `norm_bits`.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tta_core.daf.bit_alloc import FIDELITY, Allocation, UnitChoice, greedy_bits
from tta_core.memory.codec import CodecPlan
from tta_core.memory.predict import SaveProfile, predicted_bytes
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
             keep: Mapping[str, float | str] | None = None, act_masks: bool = True
             ) -> CodecPlan:
    """Uniform DAF widths: frozen conv/linear inputs dropped, the rest at `bits`; units
    named in `keep` (SURGEON's pruned units) keep their keep ratio instead."""
    check_activation_bits(bits)
    trainable, frozen = trainable_units(target)
    keep = dict(keep or {})
    widths = {n: bits for n in trainable if n not in keep}
    widths.update(dict.fromkeys(frozen, 0))
    return CodecPlan(keep, "dense", act_masks, bits=widths, norm_bits=bits, group=group,
                     narrow_ints=True)


def unit_choices(profile: SaveProfile, importance: Mapping[str, float],
                 widths: tuple[int, ...] = (0, 2, 4, 8), ms_per_elem: float = 0.0,
                 norm_bits: int | None = 8, group: int = 128) -> list[UnitChoice]:
    """Extra bytes and ms per width of each unit in `importance`, each measured alone (the
    others at 0 bits) by replaying the profile: two units storing one tensor at the same
    width share it, so the sum over units over-counts (never under-counts) the bytes."""
    low = dict.fromkeys(importance, 0)

    def total(bits: dict[str, int]) -> int:
        return predicted_bytes(profile, CodecPlan(bits=bits, default_bits=8, norm_bits=norm_bits,
                                                  group=group, narrow_ints=True)).total

    base = total(low)
    numel = dict.fromkeys(importance, 0)
    for e in profile.events:
        if e.unit in numel and e.role == "wgrad":
            numel[e.unit] += e.numel
    out = []
    for unit, imp in importance.items():
        mem = {b: total({**low, unit: b}) - base for b in widths}
        time = {b: ms_per_elem * numel[unit] if b else 0.0 for b in widths}
        out.append(UnitChoice(unit, float(imp), mem, time))
    return out


def budget_plan(profile: SaveProfile, importance: Mapping[str, float], mem_budget: float,
                time_budget: float = float("inf"), ms_per_elem: float = 0.0,
                norm_bits: int = 8, group: int = 128,
                fidelity: Mapping[int, float] = FIDELITY) -> tuple[CodecPlan, Allocation]:
    """Greedy DAF widths for the units in `importance` under both budgets (bytes: the whole
    forward's saved bytes, the other saves included at their fixed encodings)."""
    chosen = unit_choices(profile, importance, ms_per_elem=ms_per_elem, norm_bits=norm_bits,
                          group=group)
    all_low = CodecPlan(bits=dict.fromkeys(importance, 0), default_bits=8,
                        norm_bits=norm_bits, group=group, narrow_ints=True)
    fixed = predicted_bytes(profile, all_low).total  # what the units' widths do not change
    alloc = greedy_bits(chosen, mem_budget - fixed, time_budget, fidelity)
    plan = CodecPlan(bits=alloc.bits, default_bits=8, norm_bits=norm_bits, group=group,
                     narrow_ints=True)
    return plan, alloc

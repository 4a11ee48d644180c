"""DAF's budgeted widths for the activation codec (the uniform widths a method asks for
with `activation_bits` are tta_core.memory.widths: daf_plan, shared with SURGEON and
AdaShadow).

budget_plan: DAF's budgeted widths (bit_alloc.greedy_bits) for the trainable conv/linear
units from one profiled forward (predict.SaveProfile): each unit's bytes per width are
replayed by the byte predictor; its time per width is `ms_per_elem` * entries stored (the
quantize + dequantize kernels); widths of norm units stay at `norm_bits`.
"""

from __future__ import annotations

from collections.abc import Mapping

from tta_core.daf.bit_alloc import FIDELITY, Allocation, UnitChoice, greedy_bits
from tta_core.memory.codec import CodecPlan
from tta_core.memory.predict import SaveProfile, predicted_bytes


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

"""Per-unit memory costs for memory_planner from a measured save profile (tta_core.memory).

One dense profiling forward (memory.profile_saves) records every save with its unit, role
and storage; the codec's storage rules (memory.codec: a dense save is held once per
storage, an encoding once per (tensor view, encoding)) then give, without running the
model again, with every unit's conv/linear input in its frozen form (`frozen_keep`: a
recorded unit that is not updated never reads it, dx needs only the weight):

    mx[l]    bytes of the storages and encodings whose lowest saving unit is l;
    e[g]     bytes of those whose lowest saving unit is below g and another is >= g: with
             recording from g, e[g] + sum_{l >= g} mx[l] is exactly the codec's prediction
             (memory.predicted_bytes) of the recorded units' saves with no unit updated;
    mw[l, j] per conv/linear input of l whose encoding at keep option j differs from the
             frozen one: its bytes at keep j, minus the frozen form's bytes when only l
             saves that form (it then disappears); summed, >= 0.

So M is exact for plans with no updated unit sharing an encoding, and an upper bound
otherwise: a block input read by conv1 and the downsample conv counts once per updated
unit even when both use one keep ratio, and a dense keep-1 input that another recorded
unit already holds dense is counted again. Saves before the first unit are unit 0's. A
profile is for one input shape and batch size. Uses torch (memory.predict); the solver in
memory_planner is numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tta_core.adashadow.memory_planner import DEFAULT_FIDELITY, DEFAULT_KEEPS, MemoryCosts
from tta_core.memory import DENSE, CodecPlan, SaveProfile, predicted_bytes
from tta_core.memory.codec import MASK
from tta_core.memory.ledger import SaveEvent
from tta_core.memory.packed import mask_nbytes, pruned_nbytes
from tta_core.memory.scope import BEFORE_UNITS, WGRAD

DEFAULT_FROZEN_KEEP = 0.01  # ~1 bit + 0.04 B per element: about the least the codec holds


def _key(e: SaveEvent, enc: str | float) -> tuple:
    """What the codec stores once: a dense storage, or one encoding of one tensor view."""
    return ("dense", e.storage) if enc == DENSE else ("enc", e.view, enc)


def _nbytes(e: SaveEvent, enc: str | float) -> int:
    """Bytes of a save under an encoding (memory.predict's rule)."""
    if enc == DENSE:
        return e.storage_nbytes
    if enc == MASK:
        return mask_nbytes(e.numel)
    return pruned_nbytes(e.numel, round(min(float(enc), e.nonzero) * e.numel), e.elem)


@dataclass
class _Held:
    """One stored object under the frozen plan: bytes, and which (unit, role) save it."""

    nbytes: int
    savers: set[tuple[int, str]] = field(default_factory=set)


def _unit_index(profile: SaveProfile) -> list[int]:
    """Unit index of every event (saves before the first unit: 0)."""
    index = {name: i for i, name in enumerate(profile.unit_names)}
    out = []
    for e in profile.events:
        u = 0 if e.unit == BEFORE_UNITS else index.get(e.unit)
        if u is None:
            raise ValueError(f"profile event of unknown unit {e.unit!r}")
        out.append(u)
    return out


def _frozen_split(profile: SaveProfile, units: list[int], frozen: CodecPlan
                  ) -> tuple[np.ndarray, np.ndarray, dict[tuple, _Held]]:
    """(mx, e, held objects) under the frozen plan (module docstring)."""
    n = len(profile.unit_names)
    held: dict[tuple, _Held] = {}
    for e, u in zip(profile.events, units, strict=True):
        enc = frozen.encoding(e.role, e.unit, e.elem)
        held.setdefault(_key(e, enc), _Held(_nbytes(e, enc))).savers.add((u, e.role))
    mx, entry = np.zeros(n), np.zeros(n + 1)
    for obj in held.values():
        lo, hi = min(s[0] for s in obj.savers), max(s[0] for s in obj.savers)
        mx[lo] += obj.nbytes
        entry[lo + 1] += obj.nbytes  # e[g] for lo < g <= hi
        entry[hi + 1] -= obj.nbytes
    return mx, np.cumsum(entry)[:n], held


def _update_bytes(profile: SaveProfile, units: list[int], frozen: CodecPlan,
                  held: dict[tuple, _Held], keeps: Sequence[float]) -> np.ndarray:
    """mw (N, K): bytes added by updating each unit at each keep option."""
    mw = np.zeros((len(profile.unit_names), len(keeps)))
    for j, keep in enumerate(keeps):
        option = CodecPlan({}, float(keep), frozen.act_masks)
        seen: set[tuple] = set()
        for e, u in zip(profile.events, units, strict=True):
            if e.role != WGRAD:
                continue
            enc, enc_f = option.encoding(e.role, e.unit, e.elem), frozen.encoding(
                e.role, e.unit, e.elem)
            if enc == enc_f or (u, _key(e, enc)) in seen:
                continue
            seen.add((u, _key(e, enc)))
            mw[u, j] += _nbytes(e, enc)
            key_f = _key(e, enc_f)
            if (u, key_f) not in seen and held[key_f].savers == {(u, WGRAD)}:
                seen.add((u, key_f))
                mw[u, j] -= held[key_f].nbytes  # the frozen form disappears
    return np.maximum(mw, 0.0)


def memory_costs(profile: SaveProfile, keeps: Sequence[float] = DEFAULT_KEEPS,
                 fidelity: Sequence[float] | np.ndarray = DEFAULT_FIDELITY,
                 frozen_keep: float = DEFAULT_FROZEN_KEEP, act_masks: bool = True,
                 record_start: np.ndarray | None = None) -> MemoryCosts:
    """MemoryCosts of the module docstring from one profile (no model run).

    Without the codec (plain eager autograd) use keeps=(1.0,), fidelity=(1.0,),
    frozen_keep=1.0, act_masks=False: memory then depends on d = min(S) only."""
    if not profile.unit_names:
        raise ValueError("the profile has no units")
    if isinstance(frozen_keep, bool) or not 0 < frozen_keep <= 1:
        raise ValueError(f"frozen_keep must be in (0, 1], got {frozen_keep}")
    if len(keeps) == 0:
        raise ValueError("keeps is empty: give at least one keep ratio")
    frozen = CodecPlan({}, float(frozen_keep), act_masks)
    units = _unit_index(profile)
    mx, entry, held = _frozen_split(profile, units, frozen)
    mw = _update_bytes(profile, units, frozen, held, keeps)
    return MemoryCosts(mx, mw, np.asarray(keeps, dtype=np.float64),
                       np.asarray(fidelity, dtype=np.float64), record_start, entry)


def codec_plan(update: np.ndarray, keep: np.ndarray, unit_names: Sequence[str],
               frozen_keep: float = DEFAULT_FROZEN_KEEP, act_masks: bool = True) -> CodecPlan:
    """The codec settings that run a plan as costed (MemoryPlan.update / .keep): updated
    units at their keep ratio, every other unit at frozen_keep."""
    upd = np.asarray(update, dtype=bool)
    if upd.shape != (len(unit_names),) or np.shape(keep) != upd.shape:
        raise ValueError(f"update {upd.shape} and keep {np.shape(keep)} do not match "
                         f"{len(unit_names)} unit names")
    chosen = {name: float(keep[i]) for i, name in enumerate(unit_names) if upd[i]}
    return CodecPlan(chosen, frozen_keep, act_masks)


def replay_bytes(profile: SaveProfile, update: np.ndarray, keep: np.ndarray, record_from: int,
                 frozen_keep: float = DEFAULT_FROZEN_KEEP, act_masks: bool = True) -> int:
    """The codec's deduplicated bytes of a plan recorded from unit `record_from` on
    (memory.predicted_bytes of those units' saves): the exact counterpart of the additive
    MemoryPlan.predicted_bytes, which is never below it. 0 for an empty plan."""
    upd = np.asarray(update, dtype=bool)
    if not upd.any():
        return 0
    units = _unit_index(profile)
    events = [e for e, u in zip(profile.events, units, strict=True) if u >= record_from]
    plan = codec_plan(upd, keep, profile.unit_names, frozen_keep, act_masks)
    return predicted_bytes(SaveProfile(events, profile.unit_names, profile.input_shape),
                           plan).total

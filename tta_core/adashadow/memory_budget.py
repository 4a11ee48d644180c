"""AdaShadow under a saved-activation memory budget: costs, solve, run.

With `PlanningConfig.memory_budget_mb` set, the planning service plans with
memory_planner.solve_with_memory (latency and memory at once) instead of planner.solve,
and the engine (lazy graph mode) re-runs the tail from the first updated unit's stage
under the ActivationCodec with the plan's keep ratios, so what autograd holds is what
the plan was costed for:

- SaveCosts: the per-unit memory costs (memory_costs.memory_costs) of a staged model for
  one input shape, from one profiling forward of the first batch of that shape (cached
  per shape). The profile runs stage by stage, each stage's graph freed before the next
  (one stage's dense saves at a time, never the whole net's), every stage input
  requiring grad as inside a recorded tail; storages shared across stages keep one
  identity (one counter over the whole run). Recording starts at a stage
  (record_start = stage start): lazy mode re-runs whole stages.
- solve_plan: planner.solve without a budget (unchanged), solve_with_memory with one.
- TailRecorder: the lazy tail's forward + entropy loss, under the codec when a budget is
  set (updated units at their keep, every other unit's conv/linear input at the frozen
  keep, ReLU saves as exact 1-bit masks, BN inputs dense), and the StepResult stats of
  what the codec measured.

Measured vs predicted: the plan's `predicted_bytes` (the DP's additive M) is an upper
bound of the codec's deduplicated bytes of the same plan on the profiled batch
(memory_costs.replay_bytes, which the measured bytes match closely; tests); the first
recorded stage's input does not require grad in the engine, so a frozen first conv there
saves nothing, which the profile (input requiring grad) counts: one more over-estimate.
Bytes scale with the data only through the nonzero share of pruned inputs, profiled on
the first real batch of each shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from tta_core.adashadow import planner
from tta_core.adashadow.memory_costs import DEFAULT_FROZEN_KEEP, codec_plan, memory_costs
from tta_core.adashadow.memory_planner import (
    DEFAULT_FIDELITY,
    DEFAULT_KEEPS,
    MemoryCosts,
    MemoryPlan,
    solve_with_memory,
)
from tta_core.memory import ActivationCodec, SavedActivationCounter, SavedBytes, SaveProfile
from tta_core.memory.widths import daf_plan
from tta_core.model.norms import set_bn_mode
from tta_core.model.source import build_card_model, load_card
from tta_core.model.units import NORM_UNIT_KINDS, StagedModel, decompose
from tta_core.runtime import losses

MIB = 2**20


def check_budget_mib(name: str, value: object) -> float | None:
    """A memory budget in MiB as a float (None: no budget); one-line ValueError naming
    `name` for anything else than a finite number > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a number of MiB > 0 (or None: no budget), "
                         f"got {value!r}")
    return float(value)


def budget_from_free(fixed_mib: float | None, share: float, free_mib: float) -> float | None:
    """The memory budget of the next plan, MiB: `fixed_mib` (None: none), and with `share`
    in (0, 1] at most that share of the memory the resource monitor reports free
    (`free_mib` = mem_total_mb - mem_used_mb; NaN, stale telemetry: the fixed budget
    alone). A machine with less free memory than its fixed budget plans within what it
    has; never below 0.001 MiB (nothing fits, rather than no budget)."""
    if not (math.isfinite(share) and 0.0 <= share <= 1.0):
        raise ValueError(f"memory budget free share must be in [0, 1], got {share!r}")
    if share == 0.0 or not math.isfinite(free_mib):
        return fixed_mib
    live = max(share * free_mib, 1e-3)
    return live if fixed_mib is None else min(fixed_mib, live)


def profile_stages(staged: StagedModel, x: Tensor) -> SaveProfile:
    """Every save of a recorded forward of x (+ entropy loss), stage by stage (module
    docstring): the model's train/eval modes and requires_grad as they are."""
    counter = SavedActivationCounter(staged, record=True)
    with torch.enable_grad(), counter:
        h = x
        for s in range(len(staged.stages)):
            out = staged.stages[s].module(h.detach().requires_grad_(True))
            if s == len(staged.stages) - 1:
                out = losses.entropy_loss(out)
            h = out.detach()
            del out  # frees this stage's graph (and its saves) before the next stage
    return SaveProfile(counter.events, list(counter.scope.unit_names), tuple(x.shape))


class SaveCosts:
    """MemoryCosts of a staged model per input shape, profiled once per shape (cached)."""

    def __init__(self, staged: StagedModel, frozen_keep: float = DEFAULT_FROZEN_KEEP,
                 keeps: Sequence[float] = DEFAULT_KEEPS,
                 fidelity: Sequence[float] = DEFAULT_FIDELITY) -> None:
        self.staged = staged
        self.frozen_keep, self.keeps, self.fidelity = frozen_keep, keeps, fidelity
        self._cache: dict[tuple[int, ...], tuple[SaveProfile, MemoryCosts]] = {}

    def profile(self, x: Tensor) -> SaveProfile:
        """The save profile of a batch shaped like x (profiled on x the first time)."""
        return self._entry(x)[0]

    def costs(self, x: Tensor) -> MemoryCosts:
        """The memory costs of a batch shaped like x (recording from stage starts)."""
        return self._entry(x)[1]

    def _entry(self, x: Tensor) -> tuple[SaveProfile, MemoryCosts]:
        key = tuple(x.shape)
        if key not in self._cache:
            prof = profile_stages(self.staged, x)
            self._cache[key] = (prof, memory_costs(
                prof, self.keeps, self.fidelity, self.frozen_keep,
                record_start=self.staged.stage_start()))
        return self._cache[key]


def solve_plan(problem: planner.PlanProblem, n_t: int, budget_mib: float | None,
               costs: MemoryCosts | None) -> tuple[planner.Plan, MemoryPlan | None]:
    """(plan, memory plan): planner.solve without a budget (memory plan None), else the
    latency + memory DP on `costs` (ValueError when they are missing)."""
    if budget_mib is None:
        return planner.solve(problem, n_t=n_t), None
    if costs is None:
        raise ValueError(f"memory_budget_mb={budget_mib} needs the model's memory costs "
                         "(SaveCosts): plan(..., memory=costs)")
    mem = solve_with_memory(problem, costs, budget_mib * MIB, n_t=n_t)
    return mem.as_plan(), mem


def memory_no_room(costs: MemoryCosts, candidates: np.ndarray | None,
                   budget_mib: float) -> str:
    """Why no candidate unit fits the memory budget ("" when one may): the least any
    recording that updates a candidate holds is over it."""
    n = len(costs.x_bytes)
    start = np.arange(n) if costs.record_start is None else np.asarray(costs.record_start)
    entry = np.zeros(n) if costs.entry_bytes is None else np.asarray(costs.entry_bytes)
    suffix = np.cumsum(np.asarray(costs.x_bytes)[::-1])[::-1]
    least = entry[start] + suffix[start] + np.asarray(costs.w_bytes).min(axis=1)
    if candidates is not None:
        least = least[np.asarray(candidates, dtype=bool)]
    if least.size == 0 or least.min() <= budget_mib * MIB:
        return ""
    return (f"no unit fits the memory budget {budget_mib:.4g} MiB (the cheapest update "
            f"holds {least.min() / MIB:.4g} MiB of saved activations): plans stay empty")


class TailRecorder:
    """What the engine records under a memory budget (module docstring), both graph modes:
    lazy: the tail re-run from the first updated unit's stage (`loss`), under the codec
    with the plan's keeps; full: the forward from the graph floor on (`recording`), under
    the codec with every candidate's conv/linear input dense (exact gradients) and the
    rest frozen, the floor raised to the lowest stage whose recording fits (`floor_unit`).
    `stats` says what the codec held. Without a budget every method is a no-op, unless
    `bits` (DAF, EngineConfig.activation_bits): then both modes record under the codec
    with daf_plan's uniform widths (the units' requires_grad decides what is stored)."""

    def __init__(self, staged: StagedModel, budget_mib: float | None, candidates: np.ndarray,
                 lazy: bool, frozen_keep: float = DEFAULT_FROZEN_KEEP,
                 bits: int | None = None) -> None:
        self.staged, self.budget_mib, self.lazy, self.bits = staged, budget_mib, lazy, bits
        self.frozen_keep = frozen_keep
        self.candidates = np.asarray(candidates, dtype=bool)
        self.names = [u.name for u in staged.units]
        self.costs = SaveCosts(staged, frozen_keep) if budget_mib is not None else None
        self.saved: SavedBytes | None = None
        self.keep: dict[str, float] = {}
        self.current: MemoryCosts | None = None
        self._predicted = math.nan

    def prepare(self, x: Tensor) -> MemoryCosts | None:
        """The memory costs of batch x as the engine records it, kept as `current` (None
        without a budget); the first batch of a shape runs the profiling forward. Full
        graph: every recorded candidate's input counts dense whether updated or not."""
        if self.costs is None:
            return None
        base = self.costs.costs(x)
        if self.lazy:
            self.current = base
        else:
            dense = int(np.argmax(base.keeps))
            mx = base.x_bytes + np.where(self.candidates, base.w_bytes[:, dense], 0.0)
            self.current = MemoryCosts(mx, np.zeros((len(mx), 1)), np.ones(1), np.ones(1),
                                       None, base.entry_bytes)
        return self.current

    def plan_costs(self, grad_from: int) -> MemoryCosts | None:
        """The costs to plan a batch with: full graph, recorded from unit `grad_from` on
        whatever the plan (g(d) = grad_from for d >= grad_from)."""
        if self.current is None or self.lazy:
            return self.current
        start = np.minimum(np.arange(len(self.names)), grad_from)
        return dataclasses.replace(self.current, record_start=start)

    def _recorded_bytes(self) -> np.ndarray:
        """Full graph: bytes held when recording from each unit on (e[g] + suffix mx)."""
        c = self.current
        assert c is not None and c.entry_bytes is not None
        return c.entry_bytes + np.cumsum(c.x_bytes[::-1])[::-1]

    def floor_unit(self) -> int:
        """Full graph: first unit of the lowest stage whose recording fits the budget
        (len(units): none fits); 0 in lazy mode or without a budget."""
        if self.lazy or self.current is None or self.budget_mib is None:
            return 0
        starts = np.unique(self.staged.stage_start())
        fits = starts[self._recorded_bytes()[starts] <= self.budget_mib * MIB]
        return int(fits[0]) if fits.size else len(self.names)

    def recording(self, grad_from: int) -> contextlib.AbstractContextManager:
        """Full graph: the codec over a forward recorded from unit `grad_from` on (a null
        context in lazy mode, without a budget or `bits`, or when nothing is recorded)."""
        if self.lazy or grad_from >= len(self.names):
            return contextlib.nullcontext()
        if self.current is None:
            return (_Recorded(self, ActivationCodec(self.staged, daf_plan(self.staged,
                                                                          self.bits)))
                    if self.bits is not None else contextlib.nullcontext())
        self._predicted = float(self._recorded_bytes()[grad_from])
        keep = np.where(self.candidates, 1.0, np.nan)
        self.keep = {self.names[i]: 1.0 for i in np.flatnonzero(self.candidates)
                     if i >= grad_from}
        return _Recorded(self, ActivationCodec(self.staged, codec_plan(
            self.candidates, keep, self.names, self.frozen_keep)))

    def loss(self, stage: int, x_stage: Tensor, update: np.ndarray,
             memory: MemoryPlan | None) -> Tensor:
        """Entropy of stages[stage:] run on x_stage with autograd; under the codec when
        there is a budget (keeps of `memory`, or 1 for the updated units of a plan made
        elsewhere: exact gradients, frozen inputs and masks still compressed)."""
        if self.costs is None:
            daf = (ActivationCodec(self.staged, daf_plan(self.staged, self.bits))
                   if self.bits is not None else contextlib.nullcontext())
            with torch.enable_grad(), daf:
                loss = losses.entropy_loss(self.staged.forward_from(stage, x_stage))
            self.saved = getattr(daf, "result", None)
            return loss
        upd = np.asarray(update, dtype=bool)
        keep = memory.keep if memory is not None else np.where(upd, 1.0, np.nan)
        codec = ActivationCodec(self.staged, codec_plan(upd, keep, self.names,
                                                        self.frozen_keep))
        with torch.enable_grad(), codec:
            loss = losses.entropy_loss(self.staged.forward_from(stage, x_stage))
        self.saved = codec.result
        self.keep = {self.names[i]: float(keep[i]) for i in np.flatnonzero(upd)}
        self._predicted = memory.predicted_bytes if memory is not None else math.nan
        return loss

    def stats(self) -> dict[str, float | int | bool]:
        """StepResult stats of the last recording since the last call ({} without a
        budget; 0 bytes when nothing was recorded): measured and predicted saved bytes and
        MiB, the budget, whether it held, the keep ratio of every unit whose dW input was
        kept ("keep:<unit>": lazy, the updated units; full, the recorded candidates)."""
        if self.costs is None:
            return self._daf_stats()
        total = self.saved.total if self.saved is not None else 0
        out: dict[str, float | int | bool] = {
            "saved_bytes": total, "saved_mib": total / MIB,
            "predicted_saved_mib": self._predicted / MIB if self.saved is not None else 0.0,
            "memory_budget_mib": float(self.budget_mib or math.nan),
            "within_memory_budget": total <= (self.budget_mib or math.inf) * MIB}
        if self.keep:
            out["keep_min"] = min(self.keep.values())
            out.update({f"keep:{u}": k for u, k in self.keep.items()})
        self.saved, self.keep, self._predicted = None, {}, math.nan
        return out


    def _daf_stats(self) -> dict[str, float | int | bool]:
        """Without a budget: what the DAF codec held ({} without `bits`)."""
        if self.bits is None:
            return {}
        total = self.saved.total if self.saved is not None else 0
        self.saved = None
        return {"saved_bytes": total, "saved_mib": total / MIB,
                "activation_bits": int(self.bits)}


class _Recorded(contextlib.AbstractContextManager):
    """The codec over one full-graph forward; its SavedBytes go to the recorder at exit."""

    def __init__(self, recorder: TailRecorder, codec: ActivationCodec) -> None:
        self.recorder, self.codec = recorder, codec

    def __enter__(self) -> ActivationCodec:
        return self.codec.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.codec.__exit__(*exc)  # type: ignore[arg-type]
        self.recorder.saved = self.codec.result


class CardSaveCosts:
    """Memory costs for a planner away from the perception model (the scheduler node):
    the card's architecture with random weights in adaptation modes (BN batch statistics,
    the `trainable` units' parameters requiring grad: "norm" or "all"), profiled on a
    random batch per batch size (cached). Keep 1 only: a LayerPlan carries no keep ratio,
    so perception runs a topic plan's units at keep 1 (TailRecorder.loss)."""

    def __init__(self, card_path: str | Path, trainable: str) -> None:
        card = load_card(card_path)
        model = build_card_model(card)
        set_bn_mode(model, "batch")
        model.requires_grad_(False)
        self.shape = (3, card.image_size, card.image_size)
        staged = decompose(model, self.shape, arch=card.arch)
        for u in staged.units:
            if trainable == "all" or u.kind in NORM_UNIT_KINDS:
                u.module.requires_grad_(True)
        self.costs = SaveCosts(staged, keeps=(1.0,), fidelity=(1.0,))

    def __call__(self, batch_size: int) -> MemoryCosts:
        """The costs of a batch of `batch_size` frames."""
        g = torch.Generator().manual_seed(0)
        return self.costs.costs(torch.randn((int(batch_size), *self.shape), generator=g))

"""The per-batch AdaShadow pipeline: forward → plan → sparse backward → reforward.

AdaShadow §4: the forward collects each unit's output statistics for the assessor and
caches the input of every stage a plan can start at; the scheduler picks units within
sigma·T; the backward asks autograd only for the selected units' parameters, so nothing
below the deepest selected unit is differentiated; the reforward restarts from the cached
input of the first updated unit's stage (memory-I/O-aware computation reuse). Modes (§5.4):
"sequential" predicts on the reforward, "parallel" returns the forward logits and adapts in
a background thread.
"""

from __future__ import annotations

import copy
import math
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.sgd import sgd

from tta_core.adashadow import assessor as assessor_mod
from tta_core.adashadow import planner, predictor
from tta_core.adashadow.memory_budget import TailRecorder
from tta_core.adashadow.memory_planner import MemoryPlan
from tta_core.adashadow.planning import (
    TRAINABLE,
    Measured,
    PlanningConfig,
    PlanningService,
    PlanOutcome,
    UnitLayout,
)
from tta_core.api import PhaseClock, PhaseTimes, PlanningInfo, StepResult
from tta_core.memory.widths import check_activation_bits
from tta_core.model.norms import BN_MODES
from tta_core.model.robust_bn import RobustBN, use_batch_stats
from tta_core.model.units import StagedModel, StageInput, stage_input_hooks
from tta_core.runtime import losses
from tta_core.runtime.options import option
from tta_core.runtime.phases import Phases
from tta_core.runtime.precision import autocast_for, check_precision, fp32_logits
from tta_core.runtime.unit_stats import UnitStatsCollector, source_seeds

MODES = ("sequential", "parallel")
GRAPHS = ("lazy", "full")
LOSSES = ("entropy", "multilayer_kl")


@dataclass
class EngineConfig(PlanningConfig):
    """Knobs of the pipeline (and, inherited, of its planning); defaults follow the paper
    (SGD lr 5e-3, alpha 0.1)."""

    lr: float = option(5e-3, "SGD learning rate (AdaShadow §4)", low=0.0)
    momentum: float = option(0.9, "SGD momentum (< 1)", low=0.0, high=1.0)
    mode: str = option("sequential", "sequential: predict on the reforward after the "
                       "update; parallel: answer with the forward, adapt in the background",
                       choices=MODES)
    loss: str = option("entropy", "adaptation loss: entropy (Tent) or multilayer_kl (the "
                       "assessor's statistics)", choices=LOSSES)
    # "batch": BN uses batch statistics (Tent-style); "source": eval; "robust": the first
    # bn_batch_layers BN layers use batch statistics (they see the corruption first and
    # their batch statistics carry it), the others running statistics that each batch's
    # own forward moves toward its batch statistics (RoTTA's robust BN, momentum
    # bn_momentum): the statistics of a few frames are noisy. The number of batch layers
    # trades the two (`tta bench --set adashadow.bn_batch_layers=K` measures it).
    bn_mode: str = option("batch", "BN statistics: batch (Tent-style), source (eval) or "
                          "robust (first bn_batch_layers on batch statistics, the rest "
                          "RoTTA's robust BN)", choices=BN_MODES)
    bn_momentum: float = option(0.05, "robust BN: momentum of the running statistics "
                                "toward a batch's of bn_momentum_batch frames",
                                low=0.0, high=1.0)
    # bn_momentum_batch: the statistics' memory counts frames, not batches (RobustBN
    # frames): a batch of n frames moves them as n / bn_momentum_batch batches of that size.
    # Per batch (0, RoTTA), batch 64 keeps a short domain's statistics for 20 batches and
    # normalises the next domain by them; batch 4 forgets within 80 frames, which a
    # label-correlated stream's few classes then carry. Larger batches are not lagged.
    bn_momentum_batch: int = option(8, "robust BN: bn_momentum is the move of a batch of "
                                    "this many frames; a batch of n frames moves the "
                                    "statistics as n / this many such batches (0: "
                                    "bn_momentum per batch, as RoTTA)", low=0)
    bn_batch_layers: int = option(3, "robust BN: the first this many BN layers use batch "
                                  "statistics", low=0)
    # bn_batch_values: the others go on batch statistics too wherever the batch gives a
    # channel this many values (batch size x spatial size): robust BN is for the noisy
    # statistics of a few frames; with many values of i.i.d. frames the batch's own are
    # better (RobustBN). Off by default: under label correlation (a camera's stream, few
    # classes for many frames) a batch's statistics carry its classes and robust BN holds
    bn_batch_values: int = option(0, "robust BN: a layer whose input gives each channel at "
                                  "least this many values (batch x height x width) "
                                  "normalises by the batch's statistics (0: never)", low=0)
    # bn_lag: each layer normalises with its statistics before this batch's move, which
    # lets a layer outside the recorded graph do both in one read of its input
    # (RobustBN.lag), in batches of up to bn_momentum_batch frames (a larger one moves
    # them by more than bn_momentum); False: RoTTA's order, two reads (README: Deviations)
    bn_lag: bool = option(True, "robust BN: normalise with the statistics before this "
                          "batch moves them (one read of the layer input; batches of up "
                          "to bn_momentum_batch frames); False: move first, as RoTTA "
                          "(two reads)")
    alpha: float = option(0.1, "assessor: EMA weight of the newest batch in the historical "
                          "unit statistics (AdaShadow)", low=0.0, high=1.0)
    reuse: bool = option(True, "reforward from the cached stage input (False: full "
                         "reforward)")
    # plan_ahead: the plan of a batch is made from the importance up to the batch before
    # (AdaShadow's history moves by alpha per batch), after that batch's answer: the
    # assessor and the DP leave the answer's path (`AdaShadowEngine.idle`, run between
    # batches; at the next batch's start when nothing called it, counted there). The
    # forward then records the autograd graph from the plan's first stage only.
    plan_ahead: bool = option(True, "plan each batch from the statistics up to the batch "
                              "before, after that batch's answer (False: plan inline after "
                              "the batch's own forward)")
    # "norm": only BN/LayerNorm units are candidates (their affine parameters, as Tent),
    # "all": every unit (the paper's layer-wise reading). Entropy minimisation on conv or
    # classifier weights with small batches collapses to one class within a few hundred
    # batches on the benchmark stream, so "norm" is the default.
    trainable: str = option("norm", "units a plan may update: norm (BN/LayerNorm affine "
                            "parameters, as Tent) or all (every unit)", choices=TRAINABLE)
    # "full" (the paper's pipeline): the forward records the autograd graph from the lowest
    # stage that any plan within the budget can reach (PlanningService.graph_floor; below it
    # the forward runs without autograd: less time and no activations kept), the backward
    # asks only for the selected units. "lazy": the forward runs without autograd and, after
    # planning, only the stages from the first updated unit's stage are re-run with it
    # (entropy loss only). Lazy keeps no activations of the head of the net alive (memory)
    # but runs the tail once more, which the planner is told (each unit's reforward time
    # counts twice). On a CPU full is the faster on ResNet-50 at 224 px, the two are within
    # noise on the 32 px small net. With a memory budget (memory_budget_mb, memory_budget):
    # "lazy" plans units and keep ratios on both budgets; "full" raises the graph floor to
    # the lowest stage whose recording fits (candidates' inputs dense: exact gradients).
    graph: str = option("full", "full: the forward records the autograd graph from the "
                        "lowest reachable stage; lazy: re-run the stages from the first "
                        "updated unit with autograd (less memory, more time)",
                        choices=GRAPHS)
    # DAF's uniform widths: what the recorded graph saves is stored at 8/4/2 bits
    # (norm-layer inputs, trainable conv/linear inputs; frozen conv inputs not at all, ReLU
    # outputs as exact 1-bit masks: tta_core.memory.widths.daf_plan). None: dense. Not with a memory
    # budget, which chooses its own encodings (keep ratios).
    activation_bits: int | None = option(None, "DAF: store what the recorded graph saves at "
                                         "8, 4 or 2 bits (None: dense; not with a memory "
                                         "budget)", choices=(2, 4, 8))

    def validate(self) -> None:
        """Raise ValueError naming the first bad value."""
        super().validate()
        if self.activation_bits is not None:
            check_activation_bits(self.activation_bits)
            if self.memory_budget_mb is not None:
                raise ValueError(f"activation_bits={self.activation_bits} and a memory budget "
                                 f"({self.memory_budget_mb:g} MiB) exclude each other: the "
                                 f"budget chooses its own encodings")
        for name, value, allowed in (("mode", self.mode, MODES), ("loss", self.loss, LOSSES),
                                     ("bn_mode", self.bn_mode, BN_MODES),
                                     ("trainable", self.trainable, TRAINABLE),
                                     ("graph", self.graph, GRAPHS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} not in {allowed}")
        if not (math.isfinite(self.bn_momentum) and 0.0 < self.bn_momentum <= 1.0):
            raise ValueError(f"bn_momentum must be in (0, 1], got {self.bn_momentum!r}")
        if isinstance(self.bn_momentum_batch, bool) or not (
                isinstance(self.bn_momentum_batch, int) and self.bn_momentum_batch >= 0):
            raise ValueError(f"bn_momentum_batch must be an integer >= 0 (0: per batch), "
                             f"got {self.bn_momentum_batch!r}")
        if self.bn_batch_values == 1:
            raise ValueError("bn_batch_values must be 0 (off) or >= 2, got 1 (one value "
                             "per channel has no variance)")
        if isinstance(self.bn_batch_layers, bool) or not (
                isinstance(self.bn_batch_layers, int) and self.bn_batch_layers >= 0):
            raise ValueError(f"bn_batch_layers must be an integer >= 0, got "
                             f"{self.bn_batch_layers!r}")
        if self.lr < 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"bad optimizer settings lr={self.lr} momentum={self.momentum}")


def robust_bn(model: nn.Module, config: EngineConfig) -> RobustBN:
    """bn_mode "robust": the first bn_batch_layers BN layers (all but the last at most)
    switched to batch statistics,
    RoTTA's robust BN on the others, disabled until a batch's own forward enables it; the
    controller runs all of them (no layer in the other modes)."""
    if config.bn_mode != "robust":
        return RobustBN([], config.bn_momentum, config.bn_lag)
    layers = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    if any(m.running_mean is None or m.running_var is None for m in layers):
        raise ValueError("bn_mode 'robust' needs BatchNorm layers with running statistics")
    # every BN layer but the last at most: a net with few BN layers (a user's small
    # segmentation net) keeps one robust layer whose affine the planner may update
    for bn in layers[:min(config.bn_batch_layers, len(layers) - 1)]:
        use_batch_stats(bn)
    rbn = RobustBN(layers, config.bn_momentum, config.bn_lag, config.bn_batch_values,
                   config.bn_momentum_batch)
    rbn.enabled = False
    return rbn


def batch_stat_units(staged: StagedModel, config: EngineConfig) -> np.ndarray:
    """Per unit: in robust mode, a BN layer normalising with batch
    statistics -- the bottom layers whose batch statistics carry the corruption; their
    output statistics are normalised, so the assessor gives them no importance, and they
    keep the source affine (as darda's trunk). All False in the other modes."""
    return np.array([config.bn_mode == "robust" and isinstance(u.module, _BatchNorm)
                     and u.module.training for u in staged.units], dtype=bool)


class ForwardTimes:
    """Forward time per frame that the graph floor compares with the budget: the faster
    of the last two forwards (one slow batch, e.g. a cold first one, does not cost the
    next one its plan). A batch served without plan runs a plain forward, without the unit
    statistics a planned batch collects (a noticeable share on a small net): its time is
    scaled by the last measured planned / plain ratio. Taken as it is, it alternated served
    and over-deadline planned batches at high frame rates; left out, a cold first batch
    over the deadline froze every later plan."""

    def __init__(self) -> None:
        self.frame_ms: deque[float] = deque(maxlen=2)
        self.last_batch = 1
        self.ratio = 1.0  # planned / plain forward per frame
        self._plain = math.nan  # the last plain forward per frame
        self._misses = 0  # plan phases in a row that found no unit to update
        self._hold = 0  # batches still to serve without a plan phase

    def note(self, ms: float, batch_size: int) -> None:
        """A planned batch's forward (with unit statistics)."""
        per = ms / batch_size
        if math.isfinite(self._plain) and self._plain > 0:
            self.ratio = max(1.0, per / self._plain)
            self._plain = math.nan  # a ratio from adjacent batches only
        self.frame_ms.append(per)
        self.last_batch = batch_size

    def note_plain(self, ms: float, batch_size: int) -> None:
        """A served batch's plain forward."""
        self._plain = ms / batch_size
        self.frame_ms.append(self._plain * self.ratio)
        self.last_batch = batch_size

    def planned(self, updated: bool) -> None:
        """A plan phase ran: after n in a row that found no unit to update (its unit
        statistics and planning were spent for nothing: at 2000 Hz on the 32 px net they
        brought the batch to the deadline), serve the next 2**(n-1) - 1 batches (<= 63)
        without one; an update ends the hold."""
        self._misses = 0 if updated else min(self._misses + 1, 7)
        self._hold = (1 << (self._misses - 1)) - 1 if self._misses else 0

    def holding(self) -> bool:
        """True (and one batch less to hold) while plan phases are held back."""
        if self._hold <= 0:
            return False
        self._hold -= 1
        return True

    def estimate_ms(self, batch_size: int) -> float:
        """A planned forward of `batch_size` frames (NaN before any forward)."""
        return min(self.frame_ms) * batch_size if self.frame_ms else math.nan


# LATE_SHEDS: a batch served without plan that starts late (a backlog) skips the robust-BN
# statistics' update (a share of its forward) to catch up first: without it a node whose
# forward alone no longer keeps up answers fewer frames in time than bn_adapt.
# THIN_ABOVE: when a served batch that moved the statistics filled more than this share of
# its deadline, the following served batches move them every other batch only, at the
# momentum of two (RobustBN.due): the statistics decay per batch as before, and half the
# served batches skip the update's cost when the deadline is nearly full.
THIN_ABOVE = 0.7


def _serve_weight(rbn: RobustBN, late_ms: float) -> int:
    """Robust-BN weight of a served batch: 0 (skip) when it starts late, else thinning."""
    return 0 if late_ms > 0.0 else rbn.due()


def _thin_after(rbn: RobustBN, weight: int, forward_ms: float, deadline_ms: float) -> None:
    """Set the thinning stride from a served batch that moved the statistics (sigma*T
    mode, NaN deadline: never thinned; thinning there cost 1.1 points offline on the small
    net at batch 4, where most batches are served)."""
    if weight > 0:
        rbn.stride = 2 if forward_ms > THIN_ABOVE * deadline_ms else 1


def _settle(res: StepResult, measured: Measured | None, phases: Phases) -> None:
    """Count the step's work after its last phase (bookkeeping, deferring the next plan)
    to its plan phase, in `res.times` and in `measured` (when its feedback is still to
    come): the budget leaves room for all of the batch's time on the path. `res.times` is
    changed in place: in parallel mode the background update writes its backward there."""
    extra = phases.settle()
    if extra <= 0.0:
        return
    res.times.plan_ms += extra
    res.times.total_ms += extra
    if measured is not None:
        measured.plan_ms += extra
        measured.total_ms = res.times.total_ms


@contextmanager
def _own_forward(collector: UnitStatsCollector, rbn: RobustBN,
                 capture: bool = True, robust: int = 1) -> Iterator[None]:
    """The batch's own forward: unit statistics captured (unless not `capture`) and
    robust-BN statistics moved with weight `robust` (RobustBN.due; 0: not moved, as in a
    reforward or the lazy re-run of the tail, which see the batch again)."""
    collector.capture, rbn.enabled, rbn.weight = capture, robust > 0, max(robust, 1)
    if capture:
        collector.resume()
    else:  # a batch served without plan: no hook calls
        collector.suspend()
    try:
        yield
    finally:
        collector.capture, rbn.enabled = False, False


@dataclass
class _Forward:
    """What the forward phase leaves for plan/backward/reforward."""

    logits: Tensor
    stats: list
    stage_inputs: list
    forward_ms: float
    grad_stage: int  # first stage whose forward recorded the autograd graph
    memory: MemoryPlan | None = None  # the plan's keeps and predicted bytes (memory budget)
    unit_inputs: dict[int, Tensor] = field(default_factory=dict)  # RobustBN.inputs, by id
    unit_outputs: dict[int, Tensor] = field(default_factory=dict)  # replayable, by unit


class _Background:
    """The parallel mode's background update: one thread at a time, its error kept for
    `join` (which raises it as RuntimeError). The thread is not a daemon: an interpreter
    that exits while an update runs first lets it finish (a daemon thread inside torch's
    backward at exit aborts the process, `terminate called without an active
    exception`), so no update is lost and no process dies with it."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # surfaced by join()
                self._error = exc
        self._thread = threading.Thread(target=run, name="adashadow-backward", daemon=False)
        self._thread.start()

    def join(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError("background adaptation failed") from err


def _replayed_units(staged: StagedModel, layout: UnitLayout) -> list:
    """Replayable units that some later unit's reuse boundary lies beyond: the forward
    keeps their outputs, by hooks installed for a recorded forward only (a served batch
    keeps PyTorch's hook-free call path)."""
    bound, stage_of = layout.stage_start, layout.stage_of_unit
    return [u for u in staged.units if u.replayable and bool(
        (bound[u.index + 1:][stage_of[u.index + 1:] == u.stage] > u.index).any())]


def _mixed_layout(t: Tensor) -> bool:
    """A channels-last activation (4-D, not also NCHW-contiguous): the gradient a pooling
    head sends back to it is NCHW, and an elementwise backward over the two layouts (the
    ReLU before the pool) takes a slow strided path."""
    return t.dim() == 4 and not t.is_contiguous() and \
        t.is_contiguous(memory_format=torch.channels_last)


def _like_channels_last(grad: Tensor) -> Tensor:
    """The gradient in the activation's channels-last layout (a no-op when it is)."""
    return grad.contiguous(memory_format=torch.channels_last)


def _loss(kind: str, fwd: _Forward, history) -> Tensor | None:
    """The batch's adaptation loss (`kind`: EngineConfig.loss); None without a history."""
    if kind == "entropy":
        return losses.entropy_loss(fwd.logits)  # lazy: no graph, recomputed in _adapt
    if history is None:
        return None  # no history yet: nothing to align to on the first batch
    return losses.multilayer_kl_loss(fwd.stats, history)


def _detached(x: StageInput) -> StageInput:
    """A stage input (one tensor or the tuple crossing an fx cut) out of the graph."""
    return tuple(t.detach() for t in x) if isinstance(x, tuple) else x.detach()


def _reforward(staged: StagedModel, x: Tensor, fwd: _Forward, first_updated: int,
               reuse: bool) -> Tensor:
    """The prediction after the update: from the first updated unit's stage input
    (`reuse`, §4), the units of that stage before it replaced by their outputs from the
    forward where they were kept (`fwd.unit_outputs`; the BN's producer from the robust-BN
    inputs otherwise), so the reforward runs only what follows them; or a full forward."""
    unit = staged.units[first_updated]
    first = staged.stages[unit.stage].first_unit
    replay = {u: t.detach() for u, t in fwd.unit_outputs.items() if first <= u < first_updated}
    kept = fwd.unit_inputs.get(id(unit.module))
    if kept is not None and unit.producer is not None and unit.producer not in replay and \
            staged.units[unit.producer].stage == unit.stage:
        replay[unit.producer] = kept.detach()
    with torch.no_grad():
        if reuse:
            return staged.forward_from(unit.stage, _detached(fwd.stage_inputs[unit.stage]),
                                       replay)
        return staged.model(x)


def _check_trainable(staged: StagedModel, plan: planner.Plan, candidates: np.ndarray,
                     trainable: str) -> None:
    """ValueError naming the units `plan` updates that may not be updated."""
    update = np.asarray(plan.update, dtype=bool)
    if (update & ~candidates).any():
        bad = [u.name for u in staged.units if update[u.index] and not candidates[u.index]]
        raise ValueError(f"plan updates units that are not trainable "
                         f"(trainable={trainable!r}): {bad[:5]}")


def _result(svc: PlanningService, fwd: _Forward, loss: Tensor | None, importance: np.ndarray,
            outcome: PlanOutcome | None, plan: planner.Plan, adapt: bool,
            loss_is_entropy: bool = False) -> StepResult:
    """The StepResult of a batch (times other than the forward filled in by the caller).
    `loss_is_entropy`: the loss is the mean entropy of these logits (EngineConfig.loss
    "entropy"), read once rather than computed again."""
    info = PlanningInfo(outcome.predicted_backward_ms if outcome else math.nan,
                        svc.backward_factor, svc.plan_phase_ms, svc.overhead_ms,
                        outcome.no_room if outcome else "",
                        outcome.deadline_ms if outcome else math.nan,
                        bool(outcome and outcome.forward_misses), bool(outcome and outcome.skipped))
    if loss_is_entropy and loss is not None:
        loss_value = entropy = float(loss.detach())
    else:
        loss_value, entropy = losses.loss_and_entropy(loss, fwd.logits)
    return StepResult(
        logits=fwd.logits.detach(), times=PhaseTimes(fwd.forward_ms), plan=plan,
        importance=importance, loss=loss_value, mean_entropy=entropy, adapted=adapt,
        units_updated=int(np.count_nonzero(plan.update)) if adapt else 0,
        predicted_total_ms=float(plan.predicted_total_ms),
        budget_ms=float(outcome.deadline_ms if outcome and not math.isnan(outcome.deadline_ms)
                        else plan.budget_ms), planning=info)


def _sgd_step(opt: torch.optim.SGD, params: list[Tensor], grads: tuple[Tensor, ...]) -> None:
    """`opt.step()` for `params` only, by torch.optim's functional SGD (the same update and
    momentum buffers in `opt.state`): the step of a few units skips the optimizer's
    per-call bookkeeping over every candidate, a sizeable share of a small net's update."""
    group, state = opt.param_groups[0], opt.state
    bufs = [state[p].get("momentum_buffer") if p in state else None for p in params]
    with torch.no_grad():
        sgd(params, list(grads), bufs, weight_decay=group["weight_decay"],
            momentum=group["momentum"], lr=group["lr"], dampening=group["dampening"],
            nesterov=group["nesterov"], maximize=group["maximize"])
    if group["momentum"]:
        for p, b in zip(params, bufs, strict=True):
            state[p]["momentum_buffer"] = b


class AdaShadowEngine:
    """Runs AdaShadow on a StagedModel whose BN mode and requires_grad are already set;
    plans with a PlanningService (the one the ROS scheduler uses too)."""

    def __init__(self, staged: StagedModel, config: EngineConfig | None = None,
                 profile: predictor.UnitProfile | None = None,
                 source_bn: dict[str, tuple[Tensor, Tensor]] | None = None) -> None:
        """`source_bn`: the checkpoint's BN running stats by unit name (captured before BN
        was switched to batch statistics); they seed the assessor's history."""
        self.staged, self.config = staged, config or EngineConfig()
        self.config.validate()
        if profile is not None and len(profile.unit_names) != len(staged.units):
            raise ValueError(f"profile has {len(profile.unit_names)} units, model has "
                             f"{len(staged.units)}")
        self.lazy = self.config.graph == "lazy" and self.config.loss == "entropy"
        # the reforward replays the outputs of the first updated unit's stage-mates before
        # it (not under a codec, which stores them packed, nor in lazy mode)
        self.replays = bool(self.config.reuse and not self.lazy and self.config.activation_bits
                            is None and self.config.memory_budget_mb is None)
        self.planning = PlanningService(UnitLayout.from_staged(staged, restart=self.replays),
                                        self.config, profile, reforward_twice=self.lazy)
        self._rbn = robust_bn(staged.model, self.config)
        self.candidates = self.planning.layout.trainable(self.config.trainable)
        self.candidates &= ~batch_stat_units(staged, self.config)  # robust: source affine
        if not self.candidates.any():
            raise ValueError(f"trainable={self.config.trainable!r} leaves no unit to update "
                             f"in {staged.arch}")
        self.params = [p for u in staged.units if self.candidates[u.index]
                       for p in u.parameters()]
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.SGD(self.params, lr=self.config.lr,
                                         momentum=self.config.momentum)
        self._opt_state0 = self.optimizer.state_dict()
        self._with_grad: list[Tensor] = []  # parameters the last update gave a gradient
        self.assessor = assessor_mod.Assessor(len(staged.units), alpha=self.config.alpha)
        self._collector = UnitStatsCollector(staged, with_grad=self.config.loss == "multilayer_kl")
        if source_bn:
            self.assessor.seed(source_seeds(staged, source_bn, self._collector.bn_input))
        self.clock = PhaseClock(self.params[0].device)  # times every phase (CUDA: synced)
        # MethodConfig.precision (when there): forwards under autocast, the rest in fp32
        self.precision = str(getattr(self.config, "precision", "fp32"))
        check_precision(self.precision, self.params[0].device)
        self._stage_inputs: list = [None] * len(staged.stages)
        self._grad_stage = 0
        # lowest stage whose input the forward keeps: a plan cannot start its reforward
        # below the recorded graph, so the inputs of the stages below are freed as the
        # forward goes on instead of being held until the plan phase (lazy: a plan may
        # start anywhere, all are kept)
        self._keep_from = 0
        self._fwd = ForwardTimes()
        if profile is not None:
            self._fwd.note(profile.forward_ms, profile.batch_size)
        self._handles = stage_input_hooks(self.staged, self._cache_stage_input)
        # outputs of _replayed units kept by the forward from unit _out_from on (_reforward)
        self._unit_out: dict[int, Tensor] = {}
        self._out_from = len(staged.units)
        self._replayed = _replayed_units(staged, self.planning.layout) if self.replays else []
        self._ahead: PlanOutcome | None = None  # plan_ahead: the next batch's plan
        self._deferred: Callable[[], None] | None = None  # work left for between batches
        self._importance: np.ndarray | None = None  # plan_ahead: the last importance
        self._job = _Background()
        self.tail = TailRecorder(staged, self.config.memory_budget_mb, self.candidates,
                                 self.lazy, bits=self.config.activation_bits)

    @property
    def profile(self) -> predictor.UnitProfile | None:
        """The offline profile the planning service uses (None: MAC-proportional)."""
        return self.planning.profile

    @profile.setter
    def profile(self, value: predictor.UnitProfile | None) -> None:
        if value is not None:
            value.check_units(self.planning.layout.unit_names)
        self.planning.profile = value

    # ------------------------------------------------------------ hooks
    def _cache_stage_input(self, s: int, t: StageInput) -> None:
        for part in t if isinstance(t, tuple) else (t,):
            if self._collector.capture and part.requires_grad and _mixed_layout(part):
                part.register_hook(_like_channels_last)
        if self._collector.capture and s >= self._keep_from:
            self._stage_inputs[s] = t
            if s == self._grad_stage:  # stages from here on may be updated: record them
                torch.set_grad_enabled(True)

    def _autocast(self) -> AbstractContextManager:
        """The context the model's forwards run in (runtime.precision.autocast_for)."""
        return autocast_for(self.params[0].device, self.precision)

    def _output_hook(self, index: int) -> Callable:
        def hook(_m: nn.Module, _args: object, out: Tensor) -> None:
            if index >= self._out_from and self._collector.capture:
                self._unit_out[index] = out
        return hook

    def close(self) -> None:
        """Remove the hooks (the engine is unusable afterwards)."""
        self.sync()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._collector.close()
        self._rbn.close()

    # ------------------------------------------------------------ phases
    def _forward(self, x: Tensor, grad_stage: int, phases: Phases) -> _Forward:
        """Forward with hooks (the forward phase); the autograd graph is recorded from
        stage grad_stage on."""
        with phases("forward"):
            logits, stats, inputs = self._recorded_forward(x, grad_stage)
        ms = phases.ms["forward"]
        self._fwd.note(ms, int(x.shape[0]))
        kept, self._rbn.inputs = self._rbn.inputs, {}
        outs, self._unit_out = self._unit_out, {}
        return _Forward(logits, stats, inputs, ms, grad_stage, unit_inputs=kept,
                        unit_outputs=outs)

    def _recorded_forward(self, x: Tensor, grad_stage: int
                          ) -> tuple[Tensor, list, list]:
        """Logits, the units' statistics and the cached stage inputs of one forward (None
        below the recorded graph, where no plan can start)."""
        self._grad_stage, self._keep_from = grad_stage, 0 if self.lazy else grad_stage
        self._stage_inputs[0] = x if self._keep_from == 0 else None
        self._out_from = self._grad_from(grad_stage) if self.replays else len(self.staged.units)
        codec = self.tail.recording(self._grad_from(grad_stage))  # memory budget, DAF
        keep = [u.module.register_forward_hook(self._output_hook(u.index))
                for u in self._replayed if u.index >= self._out_from]
        # the recorded layers' inputs are kept for the reforward where the graph keeps
        # them anyway (not under a codec, which stores them packed)
        self._rbn.keep_inputs = self.config.reuse and isinstance(codec, nullcontext)
        # restores the grad mode on exit (the stage hooks switch it on mid-forward)
        try:
            with _own_forward(self._collector, self._rbn), \
                    torch.set_grad_enabled(grad_stage == 0), codec, self._autocast():
                logits = fp32_logits(self.staged.model(x))
        finally:
            self._rbn.keep_inputs = False
            self._out_from = len(self.staged.units)
            for h in keep:
                h.remove()
        stats = self._collector.collect(x.shape[0])
        inputs, self._stage_inputs = self._stage_inputs, [None] * len(self._stage_inputs)
        return logits, stats, inputs

    def _grad_from(self, grad_stage: int) -> int:
        """First unit whose forward recorded the graph (len(units): none)."""
        stages = self.staged.stages
        return stages[grad_stage].first_unit if grad_stage < len(stages) else len(self.staged.units)

    def _floor(self, batch_size: int, hold: bool = True) -> int:
        """Lowest unit any inline plan for this batch can reach (len(units): none), from
        the forward a planned batch would take (ForwardTimes.estimate_ms). `hold`: count
        this batch against a hold of plan phases (ForwardTimes.holding)."""
        if hold and self._fwd.holding():  # plan phases that found no room: served meanwhile
            return len(self.staged.units)
        last = self._fwd.estimate_ms(batch_size)
        return max(self.planning.graph_floor(last, self.candidates, batch_size),
                   self.tail.floor_unit())  # full graph, memory budget: where it fits

    def _grad_stage_for(self, plan: planner.Plan | None, floor: int | None = None) -> int:
        """First stage that may be updated on this batch; the forward records the graph
        from there on only (AdaShadow's budget rarely reaches the bottom of the network, and
        recording costs a sizeable share of a CPU forward, plus the activations it keeps).
        `floor`: the service's graph floor (None: for a batch as large as the last)."""
        n_stages = len(self.staged.stages)
        if self.lazy:
            return n_stages  # the tail is re-run with autograd after planning
        if plan is not None:
            upd = np.asarray(plan.update, dtype=bool)
            return int(self.staged.units[int(np.argmax(upd))].stage) if upd.any() else n_stages
        floor = self._floor(self._fwd.last_batch) if floor is None else floor
        return self.staged.units[floor].stage if floor < len(self.staged.units) else n_stages

    def _adapt(self, fwd: _Forward, loss: Tensor, update: np.ndarray) -> None:
        """Backward + step; in lazy mode first re-run the tail with autograd for the loss."""
        if self.lazy:  # under the codec with a memory budget (memory_budget.TailRecorder)
            stage = self.staged.units[int(np.flatnonzero(update)[0])].stage
            loss = self.tail.loss(stage, fwd.stage_inputs[stage], update, fwd.memory)
        self._backward(loss, update)

    def _backward(self, loss: Tensor, update: np.ndarray) -> None:
        """Gradients of the selected units only; autograd skips everything below them."""
        sel = [p for u in self.staged.units if update[u.index] for p in u.parameters()]
        for p in self._with_grad:  # what zero_grad would clear: the last step's gradients
            p.grad = None
        grads = torch.autograd.grad(loss, sel)
        for p, g in zip(sel, grads, strict=True):
            p.grad = g
        self._with_grad = sel
        _sgd_step(self.optimizer, sel, grads)

    # ------------------------------------------------------------ plan phase
    def _plan_phase(self, fwd: _Forward, plan: planner.Plan | None, batch_size: int
                    ) -> tuple[Tensor | None, np.ndarray, PlanOutcome | None, planner.Plan]:
        """Loss, importance and the plan (the service's, or the external one checked).
        No loss, assessor or planner when the measured forward leaves no room for any plan
        (PlanningService.no_time): importance zeros, the empty plan."""
        grad_from = self._grad_from(fwd.grad_stage)
        late = "" if plan is not None else self.planning.no_time(
            fwd.forward_ms, batch_size, grad_from=grad_from, candidates=self.candidates)
        if late:
            outcome = self.planning.empty_outcome(fwd.forward_ms, batch_size, late,
                                                  grad_from=grad_from)
            return None, np.zeros(len(self.staged.units)), outcome, outcome.plan
        history = self.assessor.history
        if history is not None and self.config.loss == "multilayer_kl":
            history = [(m.clone(), v.clone()) for m, v in history]  # step() updates in place
        loss = _loss(self.config.loss, fwd, history)
        # units that may not be updated get importance 0: the planner never picks them
        importance = np.where(self.candidates, self.assessor.step(fwd.stats), 0.0)
        outcome = None
        if plan is None:
            outcome = self.planning.plan(importance, fwd.forward_ms,
                                         grad_from=self._grad_from(fwd.grad_stage),
                                         candidates=self.candidates, batch_size=batch_size,
                                         memory=self.tail.plan_costs(grad_from))
            plan, fwd.memory = outcome.plan, outcome.memory
        _check_trainable(self.staged, plan, self.candidates, self.config.trainable)
        return loss, importance, outcome, plan

    # ------------------------------------------------------------ public
    def step(self, x: Tensor, plan: planner.Plan | None = None) -> StepResult:
        """Adapt on batch x and return its predictions. `plan` overrides the planner."""
        self.sync()
        if plan is not None and len(plan.update) != len(self.staged.units):
            raise ValueError(f"plan has {len(plan.update)} units, model has "
                             f"{len(self.staged.units)}")
        self.tail.prepare(x)  # memory budget: one profiling forward per new input shape
        phases, b = Phases(clock=self.clock), int(x.shape[0])
        with phases("plan"):
            self.idle()  # between-batch work no idle time took: on this batch's path
            ahead = self._take_ahead(b) if plan is None else None
            if ahead is not None and not ahead.updates and self._fwd.holding():
                floor = len(self.staged.units)  # no room lately: served meanwhile
            else:
                floor = self._floor(b) if plan is None and ahead is None else 0
        if floor >= len(self.staged.units):
            return self._serve_only(x, phases, b)
        if ahead is not None:
            return self._step_ahead(x, ahead, phases, b)
        fwd = self._forward(x, self._grad_stage_for(plan, floor), phases)
        with phases("plan"):  # the plan phase: the budget counts it
            loss, importance, outcome, plan = self._plan_phase(fwd, plan, b)
            update = np.asarray(plan.update, dtype=bool)
            adapt = loss is not None and bool(update.any())
            self._fwd.planned(adapt or outcome is None)  # an external plan is never held back
            self._keep_for_reforward(fwd, update if adapt else None)
            res = _result(self.planning, fwd, loss, importance, outcome, plan, adapt,
                          self.config.loss == "entropy")
        measured = Measured(fwd.forward_ms, phases.ms["plan"], adapt,
                            planned=outcome is None or not outcome.skipped)
        self._update(x, res, fwd, loss, update if adapt else None, outcome, measured, phases)
        if self.config.plan_ahead and outcome is not None and not outcome.skipped:
            self._defer(res, None, None, importance, b)  # the next batch: this importance
        _settle(res, None, phases)
        return res

    def _step_ahead(self, x: Tensor, outcome: PlanOutcome, phases: Phases, b: int
                    ) -> StepResult:
        """A batch whose plan was made after the batch before (plan_ahead): the forward
        records the graph from the plan's first stage only and collects the statistics
        the next plan needs; the plan is checked against this batch's own forward (its
        budget scales with it; a deadline it no longer fits empties it)."""
        update = np.asarray(outcome.plan.update, dtype=bool)
        n_stages = len(self.staged.stages)
        # lazy: no graph in the forward (the tail is re-run with autograd after planning)
        grad_stage = self.staged.units[int(np.argmax(update))].stage \
            if update.any() and not self.lazy else n_stages
        fwd = self._forward(x, grad_stage, phases)
        fwd.memory = outcome.memory
        with phases("plan"):
            outcome = self.planning.refit(outcome, fwd.forward_ms, b)
            update = np.asarray(outcome.plan.update, dtype=bool)
            history = self.assessor.history
            loss = _loss(self.config.loss, fwd, history) if update.any() else None
            adapt = loss is not None
            self._fwd.planned(adapt)
            self._keep_for_reforward(fwd, update if adapt else None)
            importance = outcome.importance if outcome.importance is not None else \
                np.zeros(len(self.staged.units))
            res = _result(self.planning, fwd, loss, importance, outcome, outcome.plan, adapt,
                          self.config.loss == "entropy")
        measured = Measured(fwd.forward_ms, phases.ms["plan"], adapt)
        self._update(x, res, fwd, loss, update if adapt else None, outcome, measured, phases,
                     observe=False)
        self._defer(res, outcome, measured, fwd.stats, b)
        _settle(res, measured, phases)  # measured is read by the deferred feedback
        return res

    def _keep_for_reforward(self, fwd: _Forward, update: np.ndarray | None) -> None:
        """Free what the reforward from the first updated unit does not need (§4 reuse;
        parallel mode and a batch without update: nothing)."""
        first = self.staged.units[int(np.flatnonzero(update)[0])] if update is not None \
            else None
        reforward = first is not None and self.config.mode != "parallel"
        fwd.unit_inputs = {k: t for k, t in fwd.unit_inputs.items()
                           if reforward and k == id(first.module)}
        start = self.staged.stages[first.stage].first_unit if reforward else 0
        fwd.unit_outputs = {u: t for u, t in fwd.unit_outputs.items()
                            if reforward and start <= u < first.index}
        if first is not None:
            fwd.stage_inputs = [t if i == first.stage else None
                                for i, t in enumerate(fwd.stage_inputs)]

    def _update(self, x: Tensor, res: StepResult, fwd: _Forward, loss: Tensor | None,
                update: np.ndarray | None, outcome: PlanOutcome | None, measured: Measured,
                phases: Phases, observe: bool = True) -> None:
        """Backward and reforward of `update` (None: no update), timed into `res`; in
        parallel mode the backward starts in the background. `observe`: feed the
        measurements back to the planning now (plan_ahead: in the deferred work)."""
        if update is not None and self.config.mode == "parallel":
            measured.plan_ms += phases.settle()  # the bookkeeping around the phases
            res.times = phases.times()
            measured.total_ms = res.times.total_ms
            self._start_job(res, fwd, loss, update, outcome, measured, observe)
            return
        if update is not None:
            with phases("backward"):
                self._adapt(fwd, loss, update)
            with phases("reforward"), self._autocast():
                res.logits = fp32_logits(_reforward(
                    self.staged, x, fwd, int(np.flatnonzero(update)[0]), self.config.reuse))
            measured.backward_ms = phases.ms["backward"]
            measured.reforward_ms = phases.ms["reforward"]
        res.stats.update(self.tail.stats())
        measured.plan_ms += phases.settle()  # the bookkeeping around the phases: on the path
        res.times = phases.times()
        measured.total_ms = res.times.total_ms
        if observe:
            self.planning.observe(outcome, measured)

    # ------------------------------------------------------------ plan ahead
    def _take_ahead(self, batch_size: int) -> PlanOutcome | None:
        """The plan made for this batch after the last one (plan_ahead), or None: none was
        made (the first batch, new settings), it was made for another batch size, or it
        is empty for want of any importance (the assessor had no history yet)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.batch_size != batch_size:
            return None
        if not ahead.updates and (ahead.importance is None or not ahead.importance.any()):
            return None  # made without importance (no history yet): the batch's own
        return ahead

    def _defer(self, res: StepResult, outcome: PlanOutcome | None, measured: Measured | None,
               stats_or_importance: list | np.ndarray, batch_size: int) -> None:
        """Leave for between batches (`idle`): the planning's feedback from this batch,
        the assessor on its statistics (or its `importance` already computed inline), the
        next batch's plan; the time it takes goes to res.times.post_ms."""
        def work() -> None:
            clock = copy.copy(self.clock)
            clock.mark()
            if measured is not None:
                self.planning.observe(outcome, measured)
            importance = stats_or_importance
            if not isinstance(importance, np.ndarray):
                importance = np.where(self.candidates, self.assessor.step(importance), 0.0)
            self._importance = importance
            self._ahead = self._plan_next(importance, batch_size)
            res.times.post_ms += clock.mark()
        self._deferred = work

    def _plan_next(self, importance: np.ndarray, batch_size: int) -> PlanOutcome:
        """The next batch's plan from `importance`, for a forward like the last ones."""
        floor = self._floor(batch_size, hold=False)
        forward_ms = self._fwd.estimate_ms(batch_size)
        if floor >= len(self.staged.units) or not math.isfinite(forward_ms):
            return self.planning.empty_outcome(forward_ms if math.isfinite(forward_ms)
                                               else 0.0, batch_size)
        grad_from = self._grad_from(self.staged.units[floor].stage)
        outcome = self.planning.plan(importance, forward_ms, grad_from=grad_from,
                                     candidates=self.candidates, batch_size=batch_size,
                                     memory=self.tail.plan_costs(grad_from))
        _check_trainable(self.staged, outcome.plan, self.candidates, self.config.trainable)
        outcome.importance = importance
        return outcome

    def forget_plan(self) -> None:
        """Drop the plan made ahead (settings changed): the next batch plans inline."""
        self._ahead = None

    def idle(self) -> None:
        """Run the work left for between batches (plan_ahead: the last batch's assessor
        and the next batch's plan); a no-op when there is none. A caller with idle time
        between batches (a camera's frame gap) calls it there (the method's `finish`)."""
        work, self._deferred = self._deferred, None
        if work is not None:
            work()

    def _serve_only(self, x: Tensor, phases: Phases, batch_size: int) -> StepResult:
        """A batch no inline plan can fit (graph floor: no unit): a plain forward, no unit
        statistics, loss, assessor or planner; the result says why. Robust-BN statistics
        move unless late (LATE_SHEDS), every other batch when tight (THIN_ABOVE). Its
        forward time counts for the floor scaled to a planned batch's (note_plain)."""
        weight = _serve_weight(self._rbn, self.planning.late_ms)
        with phases("forward"), _own_forward(self._collector, self._rbn, False, weight), \
                torch.no_grad(), self._autocast():
            logits = fp32_logits(self.staged.model(x))
        forward_ms = phases.ms["forward"]
        with phases("plan"):
            _thin_after(self._rbn, weight, forward_ms, self.planning.deadline_ms(batch_size))
            self._fwd.note_plain(forward_ms, batch_size)
            outcome = self.planning.empty_outcome(forward_ms, batch_size)
            fwd = _Forward(logits, [], [], forward_ms, len(self.staged.stages))
            res = _result(self.planning, fwd, None, np.zeros(len(self.staged.units)), outcome,
                          outcome.plan, False)
        phases.settle()  # the bookkeeping around the phases: on the path
        res.times = phases.times()
        res.stats.update(self.tail.stats())  # memory budget: nothing recorded
        self.planning.observe(outcome, Measured(forward_ms, phases.ms["plan"], False,
                                                planned=False))
        if self.config.plan_ahead and self._importance is not None:
            self._defer(res, None, None, self._importance, batch_size)  # no new statistics
        return res

    def _start_job(self, res: StepResult, fwd: _Forward, loss: Tensor, update: np.ndarray,
                   outcome: PlanOutcome | None, measured: Measured, observe: bool) -> None:
        def job() -> None:  # step() syncs before it plans again: no race on the feedback
            phases = Phases(clock=copy.copy(self.clock))  # its own: another thread
            with phases("backward"):
                self._adapt(fwd, loss, update)
            res.times.backward_ms = phases.ms["backward"]
            measured.backward_ms, measured.reforward_ms = res.times.backward_ms, None
            res.stats.update(self.tail.stats())
            if observe:
                self.planning.observe(outcome, measured)
        self._job.start(job)

    def sync(self) -> None:
        """Wait for the background update (parallel mode); its step's result then has
        backward_ms filled. Raises RuntimeError if the update failed. Work left for between
        batches (`idle`) is not run."""
        self._job.join()

    def reset(self) -> None:
        """Forget optimizer momentum and assessor history (weights: see the method's reset)."""
        self.sync()
        self._deferred, self._ahead, self._importance = None, None, None
        self.optimizer.load_state_dict(self._opt_state0)
        self.optimizer.state.clear()
        self.assessor.reset()

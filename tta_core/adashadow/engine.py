"""The per-batch AdaShadow pipeline: forward → plan → sparse backward → reforward.

AdaShadow §4: the forward collects each unit's output statistics for the assessor and
caches every stage's input; the scheduler picks units within sigma·T; the backward asks
autograd only for the selected units' parameters, so nothing below the deepest selected
unit is differentiated; the reforward restarts from the cached input of the first updated
unit's stage (memory-I/O-aware computation reuse). Modes (§5.4): "sequential" predicts on
the reforward, "parallel" returns the forward logits and adapts in a background thread.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from tta_core import losses
from tta_core.adashadow import assessor as assessor_mod
from tta_core.adashadow import planner, predictor
from tta_core.adashadow.backward_feedback import BackwardFeedback
from tta_core.adashadow.fixed_costs import FixedCosts
from tta_core.api import PhaseTimes, PlanningInfo, StepResult, mean_entropy
from tta_core.model.norms import BN_MODES
from tta_core.model.unit_stats import UnitStatsCollector, source_seeds
from tta_core.model.units import StagedModel, stage_input_hooks

MODES = ("sequential", "parallel")
TRAINABLE = ("norm", "all")  # which units may be updated: normalisation layers, or all
GRAPHS = ("lazy", "full")
LOSSES = ("entropy", "multilayer_kl")


@dataclass
class EngineConfig:
    """Knobs of the pipeline; defaults follow the paper (SGD lr 5e-3, alpha 0.1)."""

    sigma: float = 0.33
    lr: float = 5e-3
    momentum: float = 0.9
    mode: str = "sequential"
    loss: str = "entropy"
    bn_mode: str = "batch"  # "batch": BN uses batch statistics (Tent-style); "source": eval
    alpha: float = 0.1
    n_t: int = planner.DEFAULT_N_T
    reuse: bool = True  # reforward from the cached stage input (False: full reforward)
    pi1: float = 1.0  # compute expansion (predictor), updated from telemetry
    pi2: float = 1.0  # memory expansion
    # correct the predicted unit times by this batch's measured forward, on top of pi1/pi2,
    # for load the telemetry misses (predictor.feedback_pis): "uniform" (every unit scaled
    # alike; right when pi1/pi2 are not live telemetry), "memory" (pi2 solved from the
    # forward; needs a live telemetry pi1), or "off"
    forward_feedback: str = "uniform"
    # EMA weight of the closed-loop backward correction (backward_feedback): predicted
    # backward times are scaled by measured / predicted of past plans. Off (0) by default
    # in the library: plans then depend only on relative unit costs, never on how fast
    # this run happened to be, so `tta bench` accuracies repeat exactly; the ROS nodes turn
    # it on (0.2), where the budget holding matters more than repeatability
    backward_feedback: float = 0.0
    # EMA weight of the measured plan phase and fixed update cost (fixed_costs), which the
    # per-unit model cannot see: the planner leaves room for them so the batch holds its
    # budget (the pipeline's promise). On by default; 0 plans with the per-unit model alone
    # (plans then never depend on how fast a run was: exactly repeatable accuracies)
    fixed_cost_feedback: float = 0.2
    # "norm": only BN/LayerNorm units are candidates (their affine parameters, as Tent),
    # "all": every unit (the paper's layer-wise reading). Entropy minimisation on conv or
    # classifier weights with small batches collapses to one class within a few hundred
    # batches (measured on the benchmark stream), so "norm" is the default.
    trainable: str = "norm"
    # "full" (the paper's pipeline): the forward records the autograd graph from the
    # lowest stage that any plan within the budget can reach (planner.lowest_feasible_unit;
    # below it the forward runs without autograd: less time and no activations kept), the
    # backward asks only for the selected units. "lazy": the forward
    # runs without autograd and, after planning, only the stages from the first updated
    # unit's stage are re-run with it (entropy loss only). Lazy keeps no activations of the
    # head of the net alive (memory) but runs the tail once more, which the planner is told
    # (each unit's reforward time counts twice). Measured on this CPU: full is faster on
    # ResNet-50 (0.41x vs 0.51x Tent's latency, batch 4, 224 px), the two are within noise
    # on the 32 px small net.
    graph: str = "full"

    def validate(self) -> None:
        """Raise ValueError naming the first bad value."""
        for name, value, allowed in (("mode", self.mode, MODES), ("loss", self.loss, LOSSES),
                                     ("bn_mode", self.bn_mode, BN_MODES),
                                     ("trainable", self.trainable, TRAINABLE),
                                     ("graph", self.graph, GRAPHS),
                                     ("forward_feedback", self.forward_feedback,
                                      predictor.FEEDBACK_MODES)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} not in {allowed}")
        if not 0.0 <= self.sigma <= 10.0 or math.isnan(self.sigma):
            raise ValueError(f"sigma {self.sigma} outside [0, 10]")
        if self.lr < 0 or not 0 <= self.momentum < 1:
            raise ValueError(f"bad optimizer settings lr={self.lr} momentum={self.momentum}")
        if self.pi1 <= 0 or self.pi2 <= 0:
            raise ValueError(f"expansion coefficients must be > 0, got {self.pi1}, {self.pi2}")
        BackwardFeedback(alpha=self.backward_feedback)  # raises on a bad alpha
        FixedCosts(alpha=self.fixed_cost_feedback)


def mac_profile(staged: StagedModel, forward_ms: float, batch_size: int,
                input_shape: tuple[int, ...]) -> predictor.UnitProfile:
    """Default profile: per-unit times proportional to MACs, scaled so sum(r) = forward_ms."""
    fwd = np.array([u.macs_fwd for u in staged.units], dtype=np.float64)
    scale = forward_ms / max(fwd.sum(), 1.0)
    dx = np.array([u.macs_dx for u in staged.units], dtype=np.float64)
    dw = np.array([u.macs_dw for u in staged.units], dtype=np.float64)
    return predictor.UnitProfile(
        model=staged.arch, device="mac-estimate", batch_size=batch_size,
        input_shape=tuple(input_shape), unit_names=[u.name for u in staged.units],
        w_ms=dw * scale, x_ms=dx * scale, r_ms=fwd * scale,
        eta=np.array([u.eta for u in staged.units]), forward_ms=float(forward_ms))


class _Timer:
    """perf_counter with cuda.synchronize when the model lives on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class _Forward:
    """What the forward phase leaves for plan/backward/reforward."""

    logits: Tensor
    stats: list
    stage_inputs: list
    forward_ms: float
    grad_stage: int  # first stage whose forward recorded the autograd graph


class AdaShadowEngine:
    """Runs AdaShadow on a StagedModel whose BN mode and requires_grad are already set."""

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
        self.profile = profile
        self._mac_profile: predictor.UnitProfile | None = None
        self.candidates = np.array([self.config.trainable == "all" or u.kind in ("bn", "ln")
                                    for u in staged.units])
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
        self.assessor = assessor_mod.Assessor(len(staged.units), alpha=self.config.alpha)
        self.backward_fb = BackwardFeedback(alpha=self.config.backward_feedback)
        self.fixed = FixedCosts(alpha=self.config.fixed_cost_feedback)
        self._collector = UnitStatsCollector(staged, with_grad=self.config.loss == "multilayer_kl")
        self.lazy = self.config.graph == "lazy" and self.config.loss == "entropy"
        if source_bn:
            self.assessor.seed(source_seeds(staged, source_bn, self._collector.bn_input))
        self._timer = _Timer(self.params[0].device)
        self._stage_inputs: list = [None] * len(staged.stages)
        self._grad_stage = 0
        self._floor_cache: tuple = (None, 0)  # (inputs of the floor, its stage)
        self._last_forward_ms = profile.forward_ms if profile is not None else float("nan")
        self._stage_of_unit = np.array([u.stage for u in staged.units])
        self._stage_start = staged.stage_start()  # fixed per model; read on every plan
        self._handles = stage_input_hooks(self.staged, self._cache_stage_input)
        self._job: threading.Thread | None = None
        self._job_error: BaseException | None = None
        self._pending: StepResult | None = None

    # ------------------------------------------------------------ hooks
    def _cache_stage_input(self, s: int, t: Tensor) -> None:
        if self._collector.capture:
            self._stage_inputs[s] = t
            if s == self._grad_stage:  # stages from here on may be updated: record them
                torch.set_grad_enabled(True)

    def close(self) -> None:
        """Remove the hooks (the engine is unusable afterwards)."""
        self.sync()
        for h in self._handles:
            h.remove()
        self._handles = []
        self._collector.close()

    # ------------------------------------------------------------ phases
    def _forward(self, x: Tensor, grad_stage: int) -> _Forward:
        """Forward with hooks; the autograd graph is recorded from stage grad_stage on."""
        t0 = self._timer.now()
        self._collector.capture = True
        self._stage_inputs[0] = x
        self._grad_stage = grad_stage
        try:
            with torch.set_grad_enabled(grad_stage == 0):  # restores the mode on exit
                logits = self.staged.model(x)
        finally:
            self._collector.capture = False
        stats = self._collector.collect(x.shape[0])
        inputs, self._stage_inputs = self._stage_inputs, [None] * len(self._stage_inputs)
        ms = (self._timer.now() - t0) * 1e3
        self._last_forward_ms = ms
        return _Forward(logits, stats, inputs, ms, grad_stage)

    def _profile_for(self, batch: int, input_shape: tuple[int, ...]) -> predictor.UnitProfile:
        """The offline profile, or MAC-proportional times (only their shape matters: they
        are always scaled to each batch's measured forward, so one serves every batch)."""
        if self.profile is not None:
            return self.profile
        if self._mac_profile is None:
            self._mac_profile = mac_profile(self.staged, 1.0, batch, input_shape)
        return self._mac_profile

    def _unit_times(self, batch: int, input_shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """Predicted w, x, r before forward feedback."""
        return predictor.runtime_times(self._profile_for(batch, input_shape), self.config.pi1,
                                       self.config.pi2)

    def _scaled(self) -> bool:
        return self.profile is None or self.config.forward_feedback != "off"

    def _feedback(self) -> str:
        # MAC times are unitless shapes: only a uniform scale to the forward makes them ms
        return "uniform" if self.profile is None else self.config.forward_feedback

    def _grad_from(self, grad_stage: int) -> int:
        """First unit whose forward recorded the graph (len(units): none)."""
        stages = self.staged.stages
        return stages[grad_stage].first_unit if grad_stage < len(stages) else len(self.staged.units)

    def _times(self, fwd: _Forward, x: Tensor) -> tuple[np.ndarray, ...]:
        w, dx, r = predictor.planning_times(self._profile_for(x.shape[0], tuple(x.shape[1:])),
                                            self.config.pi1, self.config.pi2, fwd.forward_ms,
                                            feedback=self._feedback(),
                                            grad_from=self._grad_from(fwd.grad_stage),
                                            backward_factor=self.backward_fb.factor)
        if self.lazy:
            r = 2.0 * r  # the tail runs twice: with autograd for the backward, then again
        return w, dx, r

    def _problem(self, w, dx, r, importance: np.ndarray, forward_ms: float,
                 overhead_ms: float = 0.0) -> planner.PlanProblem:
        return planner.PlanProblem(w=w, x=dx, r=r, stage_start=self._stage_start,
                                   importance=importance, forward_ms=forward_ms,
                                   sigma=self.config.sigma, overhead_ms=overhead_ms)

    def _plan(self, fwd: _Forward, x: Tensor,
              importance: np.ndarray) -> tuple[planner.Plan, float, float]:
        """The plan and its predicted backward and reforward ms by the per-unit model
        (what the backward and fixed-cost feedbacks check). T_f includes the expected plan
        phase: the budget counts from the start of the batch."""
        w, dx, r = self._times(fwd, x)
        # units below the recorded graph cannot be updated; none fits the budget anyway
        reachable = self.lazy | (self._stage_of_unit >= fwd.grad_stage)
        plan = planner.solve(self._problem(w, dx, r, np.where(reachable, importance, 0.0),
                                           fwd.forward_ms + self.fixed.plan_phase_ms,
                                           self.fixed.overhead_ms), n_t=self.config.n_t)
        if not plan.update.any():
            return plan, 0.0, 0.0
        refwd = float(r[self._stage_start[plan.first_updated]:].sum())
        return plan, planner.backward_cost(w, dx, plan.update), refwd

    def _check_backward(self, predicted_ms: float, measured_ms: float) -> None:
        """Feed a measured backward to the closed-loop correction. Lazy mode's backward
        also re-runs the tail forward, which the prediction does not count: skipped."""
        if not self.lazy:
            self.backward_fb.update(predicted_ms, measured_ms)

    def _grad_stage_for(self, x: Tensor, plan: planner.Plan | None) -> int:
        """First stage that may be updated on this batch; the forward records the graph
        from there on only (AdaShadow's budget rarely reaches the bottom of the network, and
        recording costs up to ~30 % of a CPU forward, plus the activations it keeps)."""
        n_stages = len(self.staged.stages)
        if self.lazy:
            return n_stages  # the tail is re-run with autograd after planning
        if plan is not None:
            upd = np.asarray(plan.update, dtype=bool)
            return int(self._stage_of_unit[np.argmax(upd)]) if upd.any() else n_stages
        c = self.config
        k = round(self.backward_fb.factor, 2)  # the floor moves little with it
        # the fixed costs in forwards (a unitless ratio, so the scaled floor stays
        # independent of the forward's speed), rounded down to 1/20: the cached floor is
        # then recomputed only when they move by 5 % of a forward, and never set too high
        last = self._last_forward_ms
        share = (self.fixed.plan_phase_ms, self.fixed.overhead_ms)
        share = tuple(math.floor(20.0 * v / last) / 20.0 if np.isfinite(last) and last > 0
                      else 0.0 for v in share)
        key = (tuple(x.shape), c.pi1, c.pi2, c.sigma, id(self.profile),
               self._scaled() or last, k, share)
        if self._floor_cache[0] != key:
            w, dx, r = self._unit_times(x.shape[0], tuple(x.shape[1:]))
            w, dx = k * w, k * dx
            # scaled times: the budget is proportional to the forward, so the floor does not
            # depend on it; unscaled: a forward faster than the last one only lowers it
            tf = float(r.sum()) if self._scaled() else 0.8 * last
            if not np.isfinite(tf) or not 0 < c.sigma <= 1:
                return 0
            d = planner.lowest_feasible_unit(self._problem(
                w, dx, r, np.zeros_like(w), tf * (1.0 + share[0]), tf * share[1]),
                self.candidates)
            self._floor_cache = (key, int(self._stage_of_unit[d]) if d < len(w) else n_stages)
        return self._floor_cache[1]

    def _loss(self, fwd: _Forward, history) -> Tensor | None:
        if self.config.loss == "entropy":
            return losses.entropy_loss(fwd.logits)  # lazy: no graph, recomputed in _adapt
        if history is None:
            return None  # no history yet: nothing to align to on the first batch
        return losses.multilayer_kl_loss(fwd.stats, history)

    def _adapt(self, fwd: _Forward, loss: Tensor, update: np.ndarray) -> None:
        """Backward + step; in lazy mode first re-run the tail with autograd for the loss."""
        if self.lazy:
            stage = self.staged.units[int(np.flatnonzero(update)[0])].stage
            with torch.enable_grad():
                loss = losses.entropy_loss(
                    self.staged.forward_from(stage, fwd.stage_inputs[stage]))
        self._backward(loss, update)

    def _backward(self, loss: Tensor, update: np.ndarray) -> None:
        """Gradients of the selected units only; autograd skips everything below them."""
        sel = [p for u in self.staged.units if update[u.index] for p in u.parameters()]
        self.optimizer.zero_grad(set_to_none=True)
        grads = torch.autograd.grad(loss, sel)
        for p, g in zip(sel, grads, strict=True):
            p.grad = g
        self.optimizer.step()

    def _reforward(self, x: Tensor, fwd: _Forward, first_updated: int) -> Tensor:
        stage = self.staged.units[first_updated].stage
        with torch.no_grad():
            if self.config.reuse:
                return self.staged.forward_from(stage, fwd.stage_inputs[stage].detach())
            return self.staged.model(x)

    # ------------------------------------------------------------ public
    def step(self, x: Tensor, plan: planner.Plan | None = None) -> StepResult:
        """Adapt on batch x and return its predictions. `plan` overrides the scheduler."""
        self.sync()
        if plan is not None and len(plan.update) != len(self.staged.units):
            raise ValueError(f"plan has {len(plan.update)} units, model has "
                             f"{len(self.staged.units)}")
        t0 = self._timer.now()
        fwd = self._forward(x, self._grad_stage_for(x, plan))
        t1 = self._timer.now()
        history = self.assessor.history
        if history is not None and self.config.loss == "multilayer_kl":
            history = [(m.clone(), v.clone()) for m, v in history]  # step() updates in place
        loss = self._loss(fwd, history)
        # units that may not be updated get importance 0: the planner never picks them
        # (the assessor reads the stats without recording a graph)
        importance = np.where(self.candidates, self.assessor.step(fwd.stats), 0.0)
        predicted_bwd = predicted_re = float("nan")  # unknown for an external plan
        # no trainable unit fits the budget at all (the graph floor is above every stage)
        no_room = plan is None and not self.lazy and fwd.grad_stage >= len(self.staged.stages)
        if plan is None:
            plan, predicted_bwd, predicted_re = self._plan(fwd, x, importance)
        update = np.asarray(plan.update, dtype=bool)
        if (update & ~self.candidates).any():
            bad = [u.name for u in self.staged.units if update[u.index] and not
                   self.candidates[u.index]]
            raise ValueError(f"plan updates units that are not trainable "
                             f"(trainable={self.config.trainable!r}): {bad[:5]}")
        adapt = loss is not None and bool(update.any())
        if adapt:  # keep only the stage input the reforward needs (§4 reuse)
            keep = self.staged.units[int(np.flatnonzero(update)[0])].stage
            fwd.stage_inputs = [t if i == keep else None for i, t in enumerate(fwd.stage_inputs)]
        t2 = self._timer.now()
        self.fixed.update_plan((t2 - t1) * 1e3, fwd.forward_ms)
        res = StepResult(
            logits=fwd.logits.detach(), times=PhaseTimes(fwd.forward_ms, (t2 - t1) * 1e3),
            plan=plan, importance=importance,
            loss=float(loss.detach()) if loss is not None else float("nan"),
            mean_entropy=mean_entropy(fwd.logits), adapted=adapt,
            units_updated=int(update.sum()) if adapt else 0,
            predicted_total_ms=float(plan.predicted_total_ms), budget_ms=float(plan.budget_ms),
            planning=PlanningInfo(predicted_bwd, self.backward_fb.factor,
                                  self.fixed.plan_phase_ms, self.fixed.overhead_ms,
                                  "no trainable unit fits the budget" if no_room else ""))
        if not adapt:
            self.fixed.idle()
            res.times.total_ms = (self._timer.now() - t0) * 1e3
            return res
        if self.config.mode == "parallel":
            res.times.total_ms = (self._timer.now() - t0) * 1e3
            self._start_job(res, fwd, loss, update, predicted_bwd)
            return res
        self._adapt(fwd, loss, update)
        t3 = self._timer.now()
        self._check_backward(predicted_bwd, (t3 - t2) * 1e3)
        res.logits = self._reforward(x, fwd, int(np.flatnonzero(update)[0]))
        t4 = self._timer.now()
        if not self.lazy:  # lazy's backward re-runs the tail, which no prediction counts
            self.fixed.update_adapt(predicted_bwd + predicted_re, (t4 - t2) * 1e3,
                                    fwd.forward_ms)
        res.times.backward_ms, res.times.reforward_ms = (t3 - t2) * 1e3, (t4 - t3) * 1e3
        res.times.total_ms = (t4 - t0) * 1e3
        return res

    def _start_job(self, res: StepResult, fwd: _Forward, loss: Tensor,
                   update: np.ndarray, predicted_bwd: float) -> None:
        def job() -> None:  # step() syncs before it plans again: no race on the feedback
            try:
                t = self._timer.now()
                self._adapt(fwd, loss, update)
                res.times.backward_ms = (self._timer.now() - t) * 1e3
                self._check_backward(predicted_bwd, res.times.backward_ms)
                if not self.lazy:  # no reforward in this mode: the backward's fixed cost
                    self.fixed.update_adapt(predicted_bwd, res.times.backward_ms,
                                            res.times.forward_ms)
            except BaseException as exc:  # surfaced by sync()
                self._job_error = exc
        self._pending = res
        self._job = threading.Thread(target=job, name="adashadow-backward", daemon=True)
        self._job.start()

    def sync(self) -> StepResult | None:
        """Wait for the background update (parallel mode); return the result it completed."""
        job, self._job = self._job, None
        if job is None:
            return None
        job.join()
        done, self._pending = self._pending, None
        if self._job_error is not None:
            err, self._job_error = self._job_error, None
            raise RuntimeError("background adaptation failed") from err
        return done

    def set_expansion(self, pi1: float, pi2: float) -> None:
        """Runtime calibration of the predictor (AdaShadow §3.2) from telemetry."""
        if not (pi1 > 0 and pi2 > 0):
            raise ValueError(f"expansion coefficients must be > 0, got {pi1}, {pi2}")
        self.config.pi1, self.config.pi2 = float(pi1), float(pi2)

    def reset(self) -> None:
        """Forget optimizer momentum and assessor history (weights: see the method's reset)."""
        self.sync()
        self.optimizer.load_state_dict(self._opt_state0)
        self.optimizer.state.clear()
        self.assessor.reset()

"""AdaShadow: responsive test-time adaptation by selective layer updates.

Fang et al., "AdaShadow: Responsive Test-time Model Adaptation in Non-stationary Mobile
Environments", SenSys 2024. Backprop-free importance (assessor), runtime latency
predictor, DP scheduler within sigma·T, sparse backward and reforward reuse; the pipeline
itself lives in `tta_core.adashadow.engine`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import Tensor, nn

from tta_core.adashadow.engine import AdaShadowEngine, EngineConfig
from tta_core.adashadow.predictor import UnitProfile
from tta_core.api import Plan, StepResult
from tta_core.domain.switch import DomainSwitch, bank_switch, gated_step
from tta_core.model.units import StagedModel, decompose
from tta_core.registry import register
from tta_core.runtime.deadline import apply_settings, check_settings
from tta_core.runtime.method import MethodConfig, TTAMethod
from tta_core.runtime.options import option
from tta_core.runtime.precision import PRECISIONS


@dataclass
class AdaShadowConfig(MethodConfig, EngineConfig):
    """AdaShadow settings: the engine's and its planning's (EngineConfig, one source, paper
    defaults; sigma is the acceleration factor), the shared method settings, the profile."""

    profile: UnitProfile | str | Path | None = option(
        None, "offline UnitProfile (JSON path) of per-unit times for planning (None: "
        "MAC-proportional times scaled by the measured forward)", path="read")
    # tta's default, not the paper's ("batch", Tent-style): at the few frames per batch a
    # camera node runs, robust BN gains 7-15 points (EngineConfig.bn_mode; measured there)
    bn_mode: str = option("robust", "BN statistics: robust (first bn_batch_layers on batch "
                          "statistics, the rest RoTTA's robust BN), batch (Tent-style) or "
                          "source (eval)", choices=("batch", "source", "robust"))
    domain_bank: bool = option(False, "recognise the domain, restore its banked BN + "
                               "classifier state, adapt only until the domain is stable "
                               "(tta_core.domain; trainable norm only)")


@register("adashadow")
class AdaShadow(TTAMethod):
    """Selective-update TTA: the planner picks which units to update on every batch.

    Capabilities (tta_core.api): TakesPlan, RuntimeTunable, DeadlineTunable, TakesTelemetry,
    BackgroundUpdate.
    """

    config_cls = AdaShadowConfig
    config: AdaShadowConfig
    precisions = PRECISIONS  # the engine's forwards under autocast (AdaShadowEngine.precision)
    staged: StagedModel
    engine: AdaShadowEngine

    def configure_model(self) -> None:
        # the checkpoint's BN running stats are the source domain's conv-output statistics:
        # keep them (batch-statistics BN drops them) to seed the assessor's history
        source_bn = {n: (m.running_mean.clone(), m.running_var.clone())
                     for n, m in self.model.named_modules()
                     if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     and m.running_mean is not None and m.running_var is not None}
        super().configure_model()
        if len(self.config.input_shape) != 3:
            raise ValueError(f"adashadow needs input_shape, one sample (C, H, W) at the "
                             f"model's input size (e.g. (3, 32, 32) for a 32 px model card), "
                             f"got {tuple(self.config.input_shape)}")
        prof = self.config.profile
        if isinstance(prof, (str, Path)):
            prof = UnitProfile.load(prof)
        self.staged = decompose(self.model, self.config.input_shape, self.config.arch)
        self.engine = AdaShadowEngine(self.staged, self.config, profile=prof,
                                      source_bn=source_bn)
        self.domains: DomainSwitch | None = None
        if self.config.domain_bank:
            if self.config.trainable != "norm":
                raise ValueError(f"adashadow domain_bank banks BN + classifier state only: "
                                 f"needs trainable='norm', got {self.config.trainable!r}")
            self.domains = bank_switch(self.model, self.config.input_shape,
                                       self.engine.optimizer)
            frozen = np.isin(self.unit_names, self.domains.embedder.layer_names)
            self.engine.candidates &= ~frozen  # the embedding's BN layers: as darda's trunk

    @property
    def trainable(self) -> np.ndarray:
        """Per unit: whether a plan may update it (config.trainable)."""
        return self.engine.candidates.copy()

    @property
    def unit_names(self) -> list[str]:
        """Unit names in forward order (what a LayerPlan is indexed by)."""
        return list(self.engine.planning.layout.unit_names)

    def collect_params(self) -> list[nn.Parameter]:
        return list(self.engine.params)

    def setup_optimizer(self):
        return self.engine.optimizer

    def forward_and_adapt(self, x: Tensor, plan: Plan | None = None) -> StepResult:
        if self.domains is not None:
            with self.domains.paused():  # a memory budget profiles a new shape stage by stage
                self.engine.tail.prepare(x)
            return gated_step(self.domains, self.model, x, lambda: self.engine.step(x, plan))
        return self.engine.step(x, plan=plan)

    def step(self, x: Tensor, plan: Plan | None = None) -> StepResult:
        """Adapt on x; `plan` (e.g. from the ROS `layer_plan` topic) replaces the planner's."""
        return self._step(x, plan)

    def set_sigma(self, sigma: float) -> None:
        """New latency budget factor from the next batch on."""
        if not (math.isfinite(sigma) and 0.0 < sigma <= 1.0):
            raise ValueError(f"sigma {sigma} outside (0, 1]: the budget is a share of the "
                             f"full update's time T")
        self.finish()
        self.config.sigma = float(sigma)
        self.engine.forget_plan()

    def set_deadline(self, **settings: object) -> None:
        """New deadline settings (DeadlineConfig fields: deadline_mode, deadline_ms, ...)
        from the next batch on; ValueError naming a bad one (nothing is changed then)."""
        check_settings(self.config, settings)
        self.finish()
        apply_settings(self.config, settings)
        self.engine.forget_plan()

    def set_speed(self, speed_mps: float | None) -> None:
        """The vehicle's speed for "speed" deadlines (None: unknown, the shortest one)."""
        self.engine.planning.set_speed(speed_mps)

    def warm_up(self, x: Tensor, steps: int = 3) -> None:
        """Learn the update's fixed costs (plan phase, update overhead, backward factor) on
        x before the first real batch: `steps` planned updates at sigma 1 without deadline,
        then reset() (weights, statistics, optimizer, assessor back to the source); what the
        planning learnt stays. Without it a deadline stream's first updates plan with no
        fixed cost and miss (2 of 375 batches at 1000 Hz, small net)."""
        saved = self.config.deadline_mode, self.config.sigma, self.engine.planning.late_ms
        self.set_deadline(deadline_mode="sigma")
        self.set_sigma(1.0)
        self.set_lateness(0.0)
        try:
            for _ in range(steps):
                self.step(x)
                self.finish()
        finally:
            self.set_deadline(deadline_mode=saved[0])
            self.set_sigma(saved[1])
            self.set_lateness(saved[2])
            self.reset()

    def set_lateness(self, late_ms: float) -> None:
        """The next batches start `late_ms` after their newest frame arrived
        (PlanningService.set_lateness): the deadline left is shorter by that."""
        self.engine.planning.set_lateness(late_ms)

    def set_expansion(self, pi1: float, pi2: float) -> None:
        """Live telemetry expansion factors for inline planning."""
        self.engine.planning.set_expansion(pi1, pi2)

    @property
    def expansion(self) -> tuple[float, float, bool]:
        """(pi1, pi2, live) the next inline plan uses."""
        return self.engine.planning.expansion

    def clear_expansion(self) -> None:
        """Telemetry went stale: plan with the offline factors."""
        self.engine.planning.clear_expansion()

    def finish(self) -> None:
        """Wait for the background update of the last step (parallel mode) and run the work
        left for between batches (plan_ahead: the next batch's plan; its time goes to the
        last step's times.post_ms). Called before a step, it runs outside the step's
        phases; a caller that calls it in the gap between batches takes it off the path."""
        self.engine.sync()
        self.engine.idle()

    def close(self) -> None:
        """Wait for the background update and remove the engine's (and the bank's) hooks."""
        self.engine.close()
        if self.domains is not None:
            self.domains.close()

    def reset_state(self) -> None:
        self.engine.reset()
        if self.domains is not None:
            self.domains.fresh()

"""AdaShadow: responsive test-time adaptation by selective layer updates.

Chen et al., "AdaShadow: Responsive Test-time Model Adaptation in Non-stationary Mobile
Environments", SenSys 2024. Backprop-free importance (assessor), runtime latency
predictor, DP scheduler within sigma·T, sparse backward and reforward reuse; the pipeline
itself lives in `tta_core.adashadow.engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn

from tta_core.adashadow.engine import AdaShadowEngine, EngineConfig
from tta_core.adashadow.planner import Plan
from tta_core.adashadow.predictor import UnitProfile
from tta_core.api import StepResult
from tta_core.methods import register
from tta_core.methods.base import MethodConfig, TTAMethod
from tta_core.model.units import StagedModel, decompose


@dataclass
class AdaShadowConfig(MethodConfig):
    """AdaShadow settings (paper defaults; sigma is the acceleration factor)."""

    sigma: float = 0.33
    loss: str = "entropy"  # "entropy" | "multilayer_kl"
    mode: str = "sequential"  # "sequential" | "parallel"
    alpha: float = 0.1
    n_t: int = 500
    reuse: bool = True
    trainable: str = "norm"  # "norm" (BN/LN affine, default) | "all" (every unit)
    graph: str = "full"  # "full": graph recorded in the forward | "lazy": tail only
    forward_feedback: str = "uniform"  # "uniform" | "memory" | "off" (EngineConfig)
    backward_feedback: float = 0.0  # EMA weight of the measured-backward correction; 0: off
    fixed_cost_feedback: float = 0.2  # EMA weight of plan phase + fixed update cost; 0: off
    profile: UnitProfile | str | Path | None = None  # offline profile or its JSON path


@register("adashadow")
class AdaShadow(TTAMethod):
    """Selective-update TTA; every unit is a candidate, the planner picks per batch."""

    config_cls = AdaShadowConfig
    staged: StagedModel
    engine: AdaShadowEngine

    accepts_plan = True

    def configure_model(self) -> None:
        # the checkpoint's BN running stats are the source domain's conv-output statistics:
        # keep them (batch-statistics BN drops them) to seed the assessor's history
        source_bn = {n: (m.running_mean.clone(), m.running_var.clone())
                     for n, m in self.model.named_modules()
                     if isinstance(m, nn.modules.batchnorm._BatchNorm)
                     and m.running_mean is not None and m.running_var is not None}
        super().configure_model()
        c = self.config
        prof = c.profile
        if isinstance(prof, (str, Path)):
            prof = UnitProfile.load(prof)
        self.staged = decompose(self.model, c.input_shape, c.arch)
        if prof is not None:
            prof.check_units([u.name for u in self.staged.units])
        ecfg = EngineConfig(sigma=c.sigma, lr=c.lr, momentum=c.momentum, mode=c.mode,
                            loss=c.loss, bn_mode=c.bn_mode, alpha=c.alpha, n_t=c.n_t,
                            reuse=c.reuse, forward_feedback=c.forward_feedback,
                            backward_feedback=c.backward_feedback,
                            fixed_cost_feedback=c.fixed_cost_feedback,
                            trainable=c.trainable, graph=c.graph)
        self.engine = AdaShadowEngine(self.staged, ecfg, profile=prof, source_bn=source_bn)

    def collect_params(self) -> list[nn.Parameter]:
        return list(self.engine.params)

    def setup_optimizer(self):
        return self.engine.optimizer

    def forward_and_adapt(self, x: Tensor, plan: Plan | None = None) -> StepResult:
        return self.engine.step(x, plan=plan)

    def reset_state(self) -> None:
        self.engine.reset()

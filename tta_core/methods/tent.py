"""Tent: test entropy minimisation over the affine parameters of the norm layers.

Wang et al., "Tent: Fully Test-Time Adaptation by Entropy Minimization", ICLR 2021.
Adapts the weight/bias of BatchNorm, LayerNorm and GroupNorm layers, as the peer code
does (DequanWang/tent, mariodoebler/test-time-adaptation), so LayerNorm-only models
(ViT) adapt too. Sequential mode (AdaShadow §2.2): forward, backward, SGD step, then a
reforward of the same batch with the updated model, whose logits are the prediction
(configurable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tta_core.api import PhaseClock, StepResult
from tta_core.methods import register
from tta_core.methods.base import MethodConfig, TTAMethod


@dataclass
class TentConfig(MethodConfig):
    """Tent settings; `reforward=False` returns the pre-update logits (original Tent)."""

    reforward: bool = True


@register("tent")
class Tent(TTAMethod):
    """Entropy minimisation on norm-layer weight/bias; BN uses batch statistics."""

    config_cls = TentConfig

    def configure_model(self) -> None:
        super().configure_model()
        self.train_norm_affine()

    def forward_and_adapt(self, x: Tensor) -> StepResult:
        clock = PhaseClock.for_tensor(x)
        with torch.enable_grad():
            logits = self.model(x)
            loss = self.loss(logits)
        forward_ms = clock.mark()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        backward_ms = clock.mark()
        out = self.reforward(x, logits, self.config.reforward)
        return self.result(out, forward_ms, backward_ms, clock.mark(),
                           loss=float(loss.detach()), adapted=True,
                           units_updated=len(self.params) // 2)

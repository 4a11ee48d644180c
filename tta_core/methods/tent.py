"""Tent: test entropy minimisation over the BN affine parameters.

Wang et al., "Tent: Fully Test-Time Adaptation by Entropy Minimization", ICLR 2021.
Sequential mode (AdaShadow §2.2): forward, backward, SGD step, then a reforward of the
same batch with the updated model, whose logits are the prediction (configurable).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tta_core.api import StepResult
from tta_core.methods import register
from tta_core.methods.base import MethodConfig, TTAMethod


@dataclass
class TentConfig(MethodConfig):
    """Tent settings; `reforward=False` returns the pre-update logits (original Tent)."""

    reforward: bool = True


@register("tent")
class Tent(TTAMethod):
    """Entropy minimisation on BN weight/bias; BN uses batch statistics."""

    config_cls = TentConfig

    def configure_model(self) -> None:
        super().configure_model()
        for m in self.model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.affine:
                m.requires_grad_(True)

    def collect_params(self) -> list[nn.Parameter]:
        return [p for m in self.model.modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm)
                for p in m.parameters(recurse=False) if p.requires_grad]

    def forward_and_adapt(self, x: Tensor) -> StepResult:
        t0 = time.perf_counter()
        with torch.enable_grad():
            logits = self.model(x)
            loss = self.loss(logits)
        t1 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        t2 = time.perf_counter()
        out = logits
        if self.config.reforward:
            with torch.no_grad():
                out = self.model(x)
        t3 = time.perf_counter()
        res = self.result(out, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3,
                          loss=float(loss.detach()), adapted=True,
                          units_updated=len(self.params) // 2)
        return res

"""Tent: test entropy minimisation over the affine parameters of the norm layers.

Wang et al., "Tent: Fully Test-Time Adaptation by Entropy Minimization", ICLR 2021.
Adapts the weight/bias of BatchNorm, LayerNorm and GroupNorm layers, as the peer code
does (DequanWang/tent, mariodoebler/test-time-adaptation), so LayerNorm-only models
(ViT) adapt too. Sequential mode (AdaShadow §2.2): forward, backward, SGD step, then a
reforward of the same batch with the updated model, whose logits are the prediction
(configurable).

`activation_bits` (8/4/2; DAF, tta_core.memory.daf): the adaptation forward runs under the
activation codec: the frozen conv/linear layers' inputs are not stored at all (nothing
reads them: tent updates norm affine parameters only), BN inputs are stored per-group
min-max quantized at that width and bit-packed, ReLU outputs as exact 1-bit masks.
Measured saved bytes go to StepResult.stats["saved_bytes"].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tta_core.api import PhaseClock, StepResult
from tta_core.memory import ActivationCodec
from tta_core.memory.daf import check_activation_bits, daf_plan
from tta_core.methods import register
from tta_core.methods.base import MethodConfig, TTAMethod


@dataclass
class TentConfig(MethodConfig):
    """Tent settings; `reforward=False` returns the pre-update logits (original Tent)."""

    reforward: bool = True
    activation_bits: int | None = None  # DAF: store saved activations at 8/4/2 bits


@register("tent")
class Tent(TTAMethod):
    """Entropy minimisation on norm-layer weight/bias; BN uses batch statistics."""

    config_cls = TentConfig

    def configure_model(self) -> None:
        super().configure_model()
        self.train_norm_affine()
        bits = getattr(self.config, "activation_bits", None)  # subclasses' configs may lack it
        if bits is not None:
            check_activation_bits(bits)
        self._codec = (ActivationCodec(self.model, daf_plan(self.model, bits))
                       if bits is not None else None)

    def forward_and_adapt(self, x: Tensor) -> StepResult:
        clock = PhaseClock.for_tensor(x)
        codec = self._codec
        with torch.enable_grad():
            if codec is None:
                logits = self.model(x)
            else:
                with codec:
                    logits = self.model(x)
            loss = self.loss(logits)
        forward_ms = clock.mark()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        backward_ms = clock.mark()
        out = self.reforward(x, logits, self.config.reforward)
        res = self.result(out, forward_ms, backward_ms, clock.mark(),
                          loss=float(loss.detach()), adapted=True,
                          units_updated=len(self.params) // 2)
        if codec is not None and codec.result is not None:
            res.stats["saved_bytes"] = codec.result.total
        return res

"""Tent: test entropy minimisation over the affine parameters of the norm layers.

Wang et al., "Tent: Fully Test-Time Adaptation by Entropy Minimization", ICLR 2021.
Adapts the weight/bias of BatchNorm, LayerNorm and GroupNorm layers, as the peer code does
(DequanWang/tent, mariodoebler/test-time-adaptation), so LayerNorm-only models (ViT) adapt
too. The loop (forward, entropy, backward, SGD step, reforward of the same batch whose
logits are the prediction: AdaShadow §2.2's sequential mode) is the base class's; with
`activation_bits` / `activation_budget_mb` the forward stores its saves through DAF's
codec (runtime.capabilities.MemoryOptions). Both forwards take config.precision
(autocast; the entropy on fp32 logits, BN statistics and SGD state fp32); they run eagerly
(no CUDA graphs: the recorded forward feeds a backward, the reforward follows an update).
"""

from __future__ import annotations

from dataclasses import dataclass

from tta_core.registry import register
from tta_core.runtime.capabilities import MemoryOptions
from tta_core.runtime.method import MethodConfig, TTAMethod
from tta_core.runtime.options import option
from tta_core.runtime.precision import PRECISIONS


@dataclass
class TentConfig(MethodConfig, MemoryOptions):
    """Tent settings; `reforward=False` returns the pre-update logits (original Tent)."""

    reforward: bool = option(True, "predict on the updated model (a reforward of the batch); "
                             "False: the pre-update logits (original Tent)")


@register("tent")
class Tent(TTAMethod):
    """Entropy minimisation on norm-layer weight/bias; BN uses batch statistics."""

    config_cls = TentConfig
    precisions = PRECISIONS

    def configure_model(self) -> None:
        super().configure_model()
        self.train_norm_affine()

"""BN adapt: normalise with test-batch statistics, no gradient step.

Schneider et al., "Improving robustness against common corruptions by covariate shift
adaptation", NeurIPS 2020 (and Nado et al. 2020, "prediction-time batch normalization").
"""

from __future__ import annotations

from tta_core.model.norms import set_bn_mode
from tta_core.registry import register
from tta_core.runtime.method import TTAMethod


@register("bn_adapt")
class BNAdapt(TTAMethod):
    """BN layers use the batch's mean/variance; weights never change."""

    def configure_model(self) -> None:
        set_bn_mode(self.model, "batch")
        self.model.requires_grad_(False)

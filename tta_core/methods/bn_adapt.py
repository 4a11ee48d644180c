"""BN adapt: normalise with test-batch statistics, no gradient step.

Schneider et al., "Improving robustness against common corruptions by covariate shift
adaptation", NeurIPS 2020 (and Nado et al. 2020, "prediction-time batch normalization").
The served forward takes every precision (config.precision) and, on CUDA, replays a CUDA
graph per batch shape (config.cuda_graphs): BN on batch statistics, with no running
statistics kept, is a pure function of the batch.
"""

from __future__ import annotations

from tta_core.model.norms import require_batchnorm, set_bn_mode
from tta_core.registry import register
from tta_core.runtime.method import TTAMethod
from tta_core.runtime.precision import PRECISIONS


@register("bn_adapt")
class BNAdapt(TTAMethod):
    """BN layers use the batch's mean/variance; weights never change."""

    precisions = PRECISIONS
    graphs_serve = True

    def configure_model(self) -> None:
        require_batchnorm(self.model, self.name)  # no BN: nothing to adapt, refused
        set_bn_mode(self.model, "batch")
        self.model.requires_grad_(False)

"""Source: the unadapted model in eval mode (the no-adaptation baseline).

Its served forward takes every precision (config.precision) and, on CUDA, replays a CUDA
graph per batch shape (config.cuda_graphs; eval-mode BN is a pure function of the input).
"""

from __future__ import annotations

from tta_core.registry import register
from tta_core.runtime.method import TTAMethod
from tta_core.runtime.precision import PRECISIONS


@register("source")
class Source(TTAMethod):
    """Plain inference with the source weights and BN running statistics."""

    precisions = PRECISIONS
    graphs_serve = True

    def configure_model(self) -> None:
        self.model.eval()
        self.model.requires_grad_(False)

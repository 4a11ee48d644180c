"""Source: the unadapted model in eval mode (the no-adaptation baseline)."""

from __future__ import annotations

from tta_core.registry import register
from tta_core.runtime.method import TTAMethod


@register("source")
class Source(TTAMethod):
    """Plain inference with the source weights and BN running statistics."""

    def configure_model(self) -> None:
        self.model.eval()
        self.model.requires_grad_(False)

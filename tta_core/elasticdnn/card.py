"""Model-card factory of ElasticDNN's gated master (tta_core.elasticdnn.gates): a card with
``factory: tta_core.elasticdnn.card:gated_master`` builds the base arch and gates it, so a gated
checkpoint loads through the ordinary card route (`load_source`, `tta bench --model-card`).
A card with the kwarg ``knowledge`` (a share) also builds an empty domain knowledge Θ*
(tta_core.elasticdnn.knowledge) for the checkpoint to fill in."""

from __future__ import annotations

from torch import nn

from tta_core.elasticdnn.gates import make_gated
from tta_core.elasticdnn.knowledge import attach_knowledge
from tta_core.model.arch import build_architecture


def gated_master(base_arch: str, num_classes: int, reduction: int = 4,
                 base_kwargs: dict | None = None, knowledge: float | None = None,
                 gate_scope: str = "block", base_factory: str = "") -> nn.Module:
    """`base_arch` (a tta or torchvision arch, random weights) with FBS gates on its
    block-internal convs (`gate_scope` "block", cards without the kwarg) or on every conv
    followed by a BatchNorm ("all"), and Θ* with `knowledge` share when given; the card's
    checkpoint fills them in. `base_factory`: the user's factory that builds the base (its
    card's factory; `base_arch` is then its name)."""
    base = build_architecture(base_arch, num_classes, factory=base_factory, kwargs=base_kwargs)
    master = make_gated(base, reduction, gate_scope)
    if knowledge is not None:
        attach_knowledge(master, float(knowledge), fit=False)
    return master

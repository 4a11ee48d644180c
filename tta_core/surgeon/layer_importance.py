"""SURGEON's layer importance (seed 003, Eqs. 4-7): keep ratios of saved ∂W inputs per layer.

    G_i = sqrt(sum_j dw_j^2 / N_i)              gradient importance       (Eq. 4)
    M_i = -log(m_i / sum_k m_k)                 activation-memory importance (Eq. 5)
    I_i = Norm(M_i) * Norm(G_i)                 max-normalised product    (Eq. 6)
    p_i = 1 - I_i / max_k I_k,  keep_i = 1 - p_i                          (Eq. 7)

m_i is the element count of the layer's input (what it saves for ∂W); the sum in Eq. 5
runs over every layer that ran (the official code sums over all conv/BN/linear modules,
frozen or not), the normalisations and the max over the scored (trainable) layers.
keep_i is clamped to [floor, 1] (floor 0: Eq. 7 as written, the least important layer
gets keep 0, no ∂W; the method freezes it for the batch).
Without any signal (every I_i = 0, e.g. a single layer, where M = 0) every keep is 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from tta_core.runtime.stats import gradient_rms, gradient_rms_many


@dataclass(frozen=True)
class LayerImportance:
    """Eqs. 4-7 for one batch, per scored layer (keep is clamped to [floor, 1])."""

    gradient: dict[str, float]
    memory: dict[str, float]
    importance: dict[str, float]
    keep: dict[str, float]


def gradient_importance(grads: Sequence[Tensor]) -> float:
    """Eq. 4: root mean square of the gradient entries of one layer (all its tensors)."""
    return gradient_rms(grads)


def gradient_importances(grads: Mapping[str, Sequence[Tensor]]) -> dict[str, float]:
    """Eq. 4 of every layer, with one read back to the host for all of them."""
    return gradient_rms_many(grads)


def memory_importance(sizes: Mapping[str, int]) -> dict[str, float]:
    """Eq. 5: -log of each layer's share of the total input size (layers of size 0 are
    left out: they did not run)."""
    bad = {k: v for k, v in sizes.items() if v < 0}
    if bad:
        raise ValueError(f"layer sizes must be >= 0, got {bad}")
    total = sum(sizes.values())
    return {k: -math.log(v / total) for k, v in sizes.items() if v > 0}


def _max_norm(values: Mapping[str, float]) -> dict[str, float]:
    top = max(values.values(), default=0.0)
    return {k: (v / top if top > 0 else 0.0) for k, v in values.items()}


def layer_keep(gradient: Mapping[str, float], sizes: Mapping[str, int],
               floor: float) -> LayerImportance:
    """Keep ratios (Eqs. 5-7) of the layers in `gradient` (G_i of Eq. 4), with `sizes`
    the input element counts of every layer (Eq. 5's sum); keep clamped to [floor, 1]."""
    if not 0 <= floor <= 1:
        raise ValueError(f"keep floor must be in [0, 1], got {floor}")
    memory = memory_importance(sizes)
    missing = sorted(set(gradient) - set(memory))
    if missing:
        raise ValueError(f"no input size for scored layer(s) {missing[:5]}")
    m_norm = _max_norm({k: memory[k] for k in gradient})
    g_norm = _max_norm(gradient)
    imp = {k: m_norm[k] * g_norm[k] for k in gradient}
    top = max(imp.values(), default=0.0)
    keep = {k: (max(floor, v / top) if top > 0 else 1.0) for k, v in imp.items()}
    return LayerImportance(dict(gradient), {k: memory[k] for k in gradient}, imp, keep)

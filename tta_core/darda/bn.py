"""BatchNorm set-up for domain-bank adaptation: a frozen trunk and banked upper layers.

- trunk: the BN layers the batch embedding reads (tta_core.domain.embedding) normalise
  with batch statistics and keep their source affine, so the embedding depends on the
  batch and frozen weights only, never on the adapted or swapped state;
- upper BN layers, `bn_mode`:
  "batch": normalise with batch statistics (as Tent); the banked state is their affine;
  "bank": normalise with running statistics that belong to the domain's state (eval mode),
  each forward first moves them toward the batch's (RoTTA's robust BN, momentum
  `momentum`), and they can be refreshed from a memory bank (DARDA Eq. 15, `refresh`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from tta_core.model.robust_bn import batch_norm_layers, use_batch_stats, use_running_stats

BANK_BN_MODES = ("batch", "bank")


def configure(model: nn.Module, trunk: Sequence[str], bn_mode: str) -> list[str]:
    """Set trunk and upper BN modes; returns the upper BN names (adapted and banked)."""
    if bn_mode not in BANK_BN_MODES:
        raise ValueError(f"bn_mode {bn_mode!r} not in {BANK_BN_MODES}")
    model.eval()
    model.requires_grad_(False)
    upper = []
    for name, bn in batch_norm_layers(model).items():
        if name in trunk:
            use_batch_stats(bn)
            continue
        upper.append(name)
        if bn_mode == "batch":
            use_batch_stats(bn)
        else:
            use_running_stats(bn)
    return upper


@contextmanager
def refreshing(layers: Sequence[_BatchNorm], momentum: float) -> Iterator[None]:
    """Within the block, a forward updates the layers' running stats by
    mu <- (1 - m) mu + m mu_batch (DARDA Eq. 15, PyTorch's train-mode BN update)."""
    saved = [(bn.training, bn.momentum) for bn in layers]
    try:
        for bn in layers:
            bn.train()
            bn.momentum = momentum
        yield
    finally:
        for bn, (training, mom) in zip(layers, saved, strict=True):
            bn.train(training)
            bn.momentum = mom

"""Unsupervised adaptation losses: the softmax entropy (per sample, as EATA, SAR and SURGEON
weight it, and its batch mean, Tent's loss) and AdaShadow's multi-layer KL (§4).

Segmentation logits (N x K x H x W) are per-pixel predictions: `softmax_entropy` gives an
N x H x W map, `pixel_rows` the (N·H·W) x K rows a per-sample filter (EATA's) runs on."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from tta_core.runtime.stats import gaussian_kl


def softmax_entropy(logits: Tensor) -> Tensor:
    """Per-sample Shannon entropy (nats) of softmax(logits); [B]."""
    logp = torch.log_softmax(logits.float(), dim=1)
    return -(logp.exp() * logp).sum(dim=1)


def is_dense(logits: Tensor) -> bool:
    """Whether `logits` are per-pixel (N x K x H x W, segmentation) rather than N x K."""
    return logits.ndim == 4


def pixel_rows(logits: Tensor) -> Tensor:
    """N x K logits as they are; N x K x H x W as (N·H·W) x K, one row per pixel (in the
    order of an N x H x W map's `reshape(-1)`)."""
    if not is_dense(logits):
        return logits
    return logits.permute(0, 2, 3, 1).reshape(-1, logits.shape[1])


def entropy_loss(logits: Tensor) -> Tensor:
    """Mean Shannon entropy (nats) of softmax(logits) over the batch; logits [B, K], or
    [B, K, H, W] for segmentation (the mean over every pixel: Tent's per-pixel entropy)."""
    if logits.ndim < 2 or logits.ndim == 3:
        raise ValueError(f"logits must be [B, K] or [B, K, H, W], got shape "
                         f"{tuple(logits.shape)}")
    return softmax_entropy(logits).mean()


def multilayer_kl_loss(
    stats: Sequence[tuple[Tensor, Tensor]],
    history: Sequence[tuple[Tensor, Tensor]],
    eps: float = 1e-5,
) -> Tensor:
    """L = sum_l mean_c KL(E^H_l || E^e_l): robust to small batches (AdaShadow §4).

    `stats` are the current batch's per-unit (mean, var) and carry gradients; `history`
    is detached. The per-unit channel mean matches the importance score's scale.
    """
    if len(stats) != len(history):
        raise ValueError(f"stats has {len(stats)} units, history has {len(history)}")
    if len(stats) == 0:
        raise ValueError("multilayer_kl_loss needs at least one unit")
    total = stats[0][0].new_zeros((), dtype=torch.float32)
    for i, ((mu_e, var_e), (mu_h, var_h)) in enumerate(zip(stats, history, strict=True)):
        if mu_e.shape != mu_h.shape:
            raise ValueError(f"unit {i}: stats shape {tuple(mu_e.shape)} != {tuple(mu_h.shape)}")
        kl = gaussian_kl(mu_h.detach().float(), var_h.detach().float(),
                         mu_e.float(), var_e.float(), eps)
        total = total + kl.mean()
    return total


def loss_and_entropy(loss: Tensor | None, logits: Tensor) -> tuple[float, float]:
    """A step's loss (NaN when None) and mean prediction entropy of `logits`, read from the
    device in one transfer (each float() of a CUDA tensor is a host round trip)."""
    entropy = entropy_loss(logits.detach())
    if loss is None:
        return math.nan, float(entropy)
    pair = torch.stack([loss.detach().float().reshape(()), entropy]).tolist()
    return pair[0], pair[1]


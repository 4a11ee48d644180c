"""Cheap label-preserving augmentations of a batch: what CoTTA's teacher averages over and
SURGEON's consistency regularisation compares against.

Contrast/brightness jitter, a batch-wide shift of a few pixels and light noise, relative to
each image's own mean and std (so they work on any input range). No flips: traffic-sign
arrows are chiral.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def cheap_augment(x: Tensor, gen: torch.Generator, max_shift: int = 2) -> Tensor:
    """Per-sample contrast/brightness jitter, a batch-wide shift of up to `max_shift` px
    and light Gaussian noise, relative to each image's own mean and std (range-agnostic)."""
    n = x.shape[0]

    def u(lo: float, hi: float) -> Tensor:
        r = torch.rand((n, 1, 1, 1), generator=gen)
        return (lo + (hi - lo) * r).to(x.device, x.dtype)

    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    std = x.std(dim=(1, 2, 3), keepdim=True) + 1e-6
    out = (x - mean) * u(0.8, 1.2) + mean + u(-0.1, 0.1) * std
    if max_shift > 0:
        dy, dx = (int(v) for v in torch.randint(-max_shift, max_shift + 1, (2,),
                                                 generator=gen))
        pad = F.pad(out, (max_shift,) * 4, mode="replicate")
        h, w = x.shape[2:]
        out = pad[:, :, max_shift + dy:max_shift + dy + h, max_shift + dx:max_shift + dx + w]
    noise = torch.randn(out.shape, generator=gen).to(x.device, x.dtype)
    return out + 0.005 * std * noise

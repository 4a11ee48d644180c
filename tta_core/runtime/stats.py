"""Per-channel statistics of unit outputs and the Gaussian KL between them.

Shared by AdaShadow's assessor (§3.1) and small-batch loss (§4), the engine's unit
statistics and DARDA's batch embedding; `gradient_rms` by SURGEON (Eq. 4) and DAF's arena,
so none of it belongs to one paper.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def _reduce_dims(ndim: int, channel_dim: int | None) -> tuple[int, tuple[int, ...]]:
    if ndim < 2:
        raise ValueError(f"channel_stats needs a batched tensor (ndim >= 2), got ndim={ndim}")
    if channel_dim is None:
        channel_dim = ndim - 1 if ndim == 3 else 1  # [B,T,D] tokens; else [B,C,...]
    channel_dim = channel_dim % ndim
    return channel_dim, tuple(d for d in range(ndim) if d != channel_dim)


_CANCEL_RATIO = 1e3  # one-pass variance used while mean^2 <= 1e3 * var (rel. error <~1e-4)


def _as_bcs(out: Tensor, channel_dim: int) -> Tensor:
    """View as [rows, C, cols] so the statistics reduce over dims (0, 2)."""
    c = out.shape[channel_dim]
    if channel_dim == out.ndim - 1:
        return out.reshape(-1, c, 1)
    return out.movedim(channel_dim, 1).reshape(out.shape[0], c, -1)


def _cpu_stats(out: Tensor, channel_dim: int) -> tuple[Tensor, Tensor]:
    """Guarded one-pass moments: E[x], E[x^2] - E[x]^2, exact two-pass where it cancels."""
    v = _as_bcs(out if out.dtype in (torch.float32, torch.float64) else out.float(), channel_dim)
    n = v.shape[0] * v.shape[2]
    mean = v.sum((0, 2)) / n
    var = (v * v).sum((0, 2)) / n - mean * mean
    if bool(((mean * mean > _CANCEL_RATIO * var) | (var <= 0)).any()):
        d = v - mean.view(1, -1, 1)  # corrected two-pass (Chan, Golub, LeVeque 1983)
        shift = d.sum((0, 2)) / n
        var = (d * d).sum((0, 2)) / n - shift * shift
        mean = mean + shift
    return mean, var


def channel_stats(out: Tensor, channel_dim: int | None = None) -> tuple[Tensor, Tensor]:
    """Per-channel (mean, population variance) of a unit output.

    The channel is dim 1 for [B,C,H,W] and [B,F], the last dim for [B,T,D] token tensors
    (override with `channel_dim`); statistics run over all other dims.

    With autograd recording (the small-batch KL loss needs gradients) or on an accelerator
    this is one torch.var_mean call. On CPU without autograd (the assessor path, under
    no_grad) var_mean's Welford reduction is slow: over all 107 unit outputs of ResNet-50
    (batch 4, 1 thread) it takes 430 ms, the BatchNorm statistics kernel 110-125 ms, an
    exact corrected two-pass 50 ms, and the one-pass sums used here 33 ms, which fall back
    to the two-pass for any tensor where a channel has mean^2 > 1e3 var (cancellation).
    """
    cdim, dims = _reduce_dims(out.ndim, channel_dim)
    if out.device.type == "cpu" and not (out.requires_grad and torch.is_grad_enabled()):
        return _cpu_stats(out, cdim)
    var, mean = torch.var_mean(out, dim=dims, correction=0)
    return mean, var


def gaussian_kl(
    mu_p: Tensor, var_p: Tensor, mu_q: Tensor, var_q: Tensor, eps: float = 1e-5
) -> Tensor:
    """Elementwise KL(N(mu_p, var_p) || N(mu_q, var_q)) in nats, variances floored at eps."""
    vp = torch.clamp(var_p, min=eps)
    vq = torch.clamp(var_q, min=eps)
    return 0.5 * (torch.log(vq / vp) + (vp + (mu_p - mu_q) ** 2) / vq - 1.0)


def gradient_rms(grads: Sequence[Tensor]) -> float:
    """Root mean square of the gradient entries of one layer (all its tensors)."""
    return gradient_rms_many({"": grads})[""]


def gradient_rms_many(layers: Mapping[str, Sequence[Tensor]]) -> dict[str, float]:
    """gradient_rms of every layer, read back to the host in one transfer (one stall on a
    GPU for the whole net instead of one per layer)."""
    sizes = {name: sum(g.numel() for g in grads) for name, grads in layers.items()}
    empty = [name for name, n in sizes.items() if n == 0]
    if empty:
        raise ValueError(f"gradient importance of a layer without gradient entries: {empty[0]!r}")
    if not layers:
        return {}
    sq = torch.stack([sum(torch.sum(g.detach().double() ** 2) for g in grads)
                      for grads in layers.values()]).tolist()
    return {name: math.sqrt(v / sizes[name]) for name, v in zip(layers, sq, strict=True)}

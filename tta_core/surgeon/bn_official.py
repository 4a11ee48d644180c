"""SURGEON's official BN gradient (option `bn_grad: official`), for reproducing its ratios.

The official code's BN backward re-normalises with the running statistics cloned *before*
the forward: it backpropagates through a batch-statistics BN whose scale and shift,
γ·σ_b/σ_r and γ·(μ_b − μ_r)/σ_r + β, are constants (σ_r, μ_r: the running statistics,
σ_b, μ_b: the batch's). Hence ∂γ = Σ g·(x − μ_r)/σ_r instead of Σ g·x̂_b, and ∂x is the
exact batch-statistics ∂x scaled per channel by σ_b/σ_r. The forward's value stays the
batch-statistics output (running statistics updated as usual). With running statistics
equal to the batch's both gradients are exact.

Here a BN module in training mode runs, inside `official_bn_grad(model)`:
y = y_grad + (y_batch − y_grad).detach(), y_grad the BN above (what autograd records and
saves: its input, as the exact BN), y_batch the ordinary output computed without grad.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _official_forward(mod: nn.modules.batchnorm._BatchNorm, x: Tensor) -> Tensor:
    """Batch-statistics output whose gradient is the official code's (module doc)."""
    dims = [d for d in range(x.ndim) if d != 1]
    with torch.no_grad():
        var_b, mean_b = torch.var_mean(x, dim=dims, unbiased=False)
        mean_r, var_r = mod.running_mean.clone(), mod.running_var.clone()
        if mod.num_batches_tracked is not None:
            mod.num_batches_tracked.add_(1)
        factor = (mod.momentum if mod.momentum is not None
                  else 1.0 / float(mod.num_batches_tracked))  # cumulative average
        y_batch = F.batch_norm(x, mod.running_mean, mod.running_var, mod.weight, mod.bias,
                               True, factor, mod.eps)
        std_r = torch.sqrt(var_r + mod.eps)
        scale = torch.sqrt(var_b + mod.eps) / std_r
        shift = (mean_b - mean_r) / std_r
    weight = mod.weight if mod.weight is not None else torch.ones_like(scale)
    bias = mod.bias if mod.bias is not None else torch.zeros_like(scale)
    y_grad = F.batch_norm(x, None, None, weight * scale, weight * shift + bias, True, 0.0,
                          mod.eps)
    with torch.no_grad():
        delta = y_batch - y_grad
    return y_grad + delta


def _targets(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
            and m.track_running_stats and m.running_mean is not None]


@contextmanager
def official_bn_grad(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the context, training-mode BN layers backpropagate as the official code."""
    mods = _targets(model) if enabled else []
    for m in mods:
        m.forward = (lambda x, _m=m: _official_forward(_m, x))  # type: ignore[method-assign]
    try:
        yield
    finally:
        for m in mods:
            del m.forward

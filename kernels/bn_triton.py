"""Robust BN's lagged pass on CUDA in one Triton kernel (tta_kernels.bn_stats dispatches
here for CUDA tensors): eval-mode BN of x with the running statistics as they are, the
batch mean and biased variance taken in the same read, then the running statistics moved
toward them (PyTorch's momentum, unbiased variance), the old ones handed back.

PyTorch does this in four launches per layer (two copies of the statistics, eval BN,
batch_norm_update_stats); at the small batches a vehicle runs, a ResNet's forward on a GPU
is bound by the host issuing kernels, not by the GPU running them, so the launches are
what robust BN costs. One program per channel walks its N x HW values of an NCHW-contiguous
float32 x; sums are of x less the old running mean (no large-sum cancellation). Channels
hold at most MAX_PER_CHANNEL values here: beyond that the GPU's time dominates and
PyTorch's passes, which spread a channel over many programs, are the faster ones.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.nn import functional as F

BLOCK = 1024  # values per step of a channel's walk
MAX_PER_CHANNEL = 1 << 16  # N * H * W above this: PyTorch's passes
_FAILED: list[str] = []  # the kernel's compile or launch error, once it failed


@triton.jit(do_not_specialize=["n", "c", "hw", "momentum", "eps"])
def _normalise_update_kernel(x_ptr, out_ptr, w_ptr, b_ptr, rm_ptr, rv_ptr, stats_ptr,
                             n, c, hw, momentum, eps, HAS_W: tl.constexpr,
                             HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    ch = tl.program_id(0)
    old_m = tl.load(rm_ptr + ch)
    old_v = tl.load(rv_ptr + ch)
    scale = 1.0 / tl.sqrt(old_v + eps)
    if HAS_W:
        scale = scale * tl.load(w_ptr + ch)
    shift = 0.0
    if HAS_B:
        shift = tl.load(b_ptr + ch)
    total = n * hw
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, total, BLOCK):
        r = start + tl.arange(0, BLOCK)
        ok = r < total
        img = r // hw
        off = img.to(tl.int64) * c * hw + ch.to(tl.int64) * hw + (r - img * hw)
        d = tl.load(x_ptr + off, mask=ok, other=0.0) - old_m
        d = tl.where(ok, d, 0.0)
        acc += d
        acc2 += d * d
        tl.store(out_ptr + off, d * scale + shift, mask=ok)
    count = total.to(tl.float32)
    mean_d = tl.sum(acc, axis=0) / count
    var = tl.maximum(tl.sum(acc2, axis=0) / count - mean_d * mean_d, 0.0)
    mean = old_m + mean_d
    unbiased = var * count / tl.maximum(count - 1.0, 1.0)
    tl.store(stats_ptr + ch, mean)
    tl.store(stats_ptr + c + ch, var)
    tl.store(stats_ptr + 2 * c + ch, old_m)
    tl.store(stats_ptr + 3 * c + ch, old_v)
    tl.store(rm_ptr + ch, (1.0 - momentum) * old_m + momentum * mean)
    tl.store(rv_ptr + ch, (1.0 - momentum) * old_v + momentum * unbiased)


def takes(x: Tensor, *stats: Tensor | None) -> bool:
    """Whether `normalise_update` takes `x` (CUDA, float32, NCHW-contiguous, at most
    MAX_PER_CHANNEL values per channel) with these per-channel float32 tensors."""
    if not (x.is_cuda and x.dtype == torch.float32 and x.dim() >= 2 and x.numel() > 0
            and x.is_contiguous()):
        return False
    c = x.shape[1]
    return x.numel() // c <= MAX_PER_CHANNEL and all(
        s is None or (s.device == x.device and s.dtype == torch.float32
                      and s.is_contiguous() and s.numel() == c) for s in stats)


def normalise_update(x: Tensor, running_mean: Tensor, running_var: Tensor, momentum: float,
                     weight: Tensor | None, bias: Tensor | None, eps: float,
                     keep_old: bool = False) -> tuple[Tensor, ...]:
    """tta_kernels.bn_stats.normalise_update for a tensor `takes` accepts: (output, batch
    mean, biased batch variance[, running mean and variance as they were])."""
    n, c = x.shape[0], x.shape[1]
    out = torch.empty_like(x)
    stats = torch.empty(4, c, device=x.device)  # mean, var, old mean, old var: one alloc
    if not _FAILED:
        try:
            _normalise_update_kernel[(c,)](
                x, out, weight if weight is not None else x,
                bias if bias is not None else x, running_mean, running_var, stats, n, c,
                x.numel() // (n * c), float(momentum), float(eps), HAS_W=weight is not None,
                HAS_B=bias is not None, BLOCK=BLOCK)
            return out, *stats.unbind(0)[:4 if keep_old else 2]
        except Exception as exc:  # any compile or launch failure
            _FAILED.append(f"{type(exc).__name__}: {exc}")
            warnings.warn(f"tta_kernels: robust BN's Triton kernel failed ({_FAILED[0]}); "
                          "PyTorch's passes from now on", RuntimeWarning, stacklevel=2)
    stats[2:].copy_(torch.stack((running_mean, running_var)))
    out = F.batch_norm(x, stats[2], stats[3], weight, bias, False, 0.0, eps)
    mean, var = torch.batch_norm_update_stats(x, running_mean, running_var, momentum)
    return out, mean, var, *stats.unbind(0)[2:4 if keep_old else 2]

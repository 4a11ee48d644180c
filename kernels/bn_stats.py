"""Robust BN's statistics pass in one C read (bn_stats.c).

`update_stats(x, running_mean, running_var, momentum)` is torch.batch_norm_update_stats
for a float32 CPU tensor, NCHW- or channels-last-contiguous: the per-channel batch mean and
biased variance, and the running statistics moved toward them (unbiased variance,
PyTorch's momentum) when given. PyTorch's pass walks each channel with Welford's update for
NCHW (4–10× the cost of reading x once) and reads a channels-last x twice (mean, then
variance); this one reads x once. NCHW: each row's values are summed less its first value
in float lanes per block, in double across blocks, and rows merged into channels with Chan
et al.'s pairwise (mean, M2) update in double. Channels-last: each channel is summed less
its value in the first row, in float lanes across channels per block of rows, in double
across blocks. No step subtracts two large sums, so a large mean with a small spread keeps
its variance. CUDA tensors and other dtypes go to PyTorch. Built like the DAF kernels
(tta_kernels.native), with OpenMP where the compiler has it: channels (NCHW) or runs of row
blocks (channels-last) are split among torch's threads (native.threads).

`normalise_update(x, running_mean, running_var, momentum, weight, bias, eps)` writes
eval-mode BN of x with the running statistics as they are in the same read, then moves
them (handing back the old ones on request): robust BN with a one-batch lag
(RobustBN.lag) at the cost of a plain eval BN.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from . import native

SOURCE = Path(__file__).with_name("bn_stats.c")
_P, _I = ctypes.c_void_p, ctypes.c_int64


def load(path: Path) -> ctypes.CDLL:
    """A built bn_stats library with its function's signature declared."""
    lib = ctypes.CDLL(str(path))
    f, tail = ctypes.c_float, [_P, _P, _P, ctypes.c_float, ctypes.c_int, _P]  # out .. old
    lib.bn_stats.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P, f, *tail]
    lib.bn_stats.restype = ctypes.c_int
    lib.bn_stats_nhwc.argtypes = [_P, _I, _I, _P, _P, _P, _P, f, *tail]
    lib.bn_stats_nhwc.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded library (built first if needed), None where it cannot be built."""
    try:
        return load(native.build_threaded(SOURCE))
    except (RuntimeError, OSError):
        return None


def _layout(x: Tensor) -> str | None:
    """"nchw" or "nhwc" where the C pass takes `x` (float32 CPU), else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() < 2 or x.numel() == 0:
        return None
    if x.is_contiguous():
        return "nchw"
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return "nhwc"
    return None


def _stats_ok(c: int, *stats: Tensor | None) -> bool:
    return all(s is None or (s.dtype == torch.float32 and s.is_contiguous() and s.numel() == c)
               for s in stats)


#: below this many values PyTorch's pass costs less than the call into C
MIN_NATIVE = 2048


def update_stats(x: Tensor, running_mean: Tensor | None, running_var: Tensor | None,
                 momentum: float) -> tuple[Tensor, Tensor]:
    """(batch mean, biased batch variance) per channel of `x`; the running statistics, when
    both given, moved by `momentum` in place: torch.batch_norm_update_stats's contract (and
    that function for what this kernel does not take)."""
    takes = _takes(x, running_mean, running_var)
    if takes is None:
        return torch.batch_norm_update_stats(x, running_mean, running_var, momentum)
    return _run(*takes, x, running_mean, running_var, momentum, None)


def _takes(x: Tensor, *stats: Tensor | None) -> tuple[ctypes.CDLL, str] | None:
    """(library, layout) where the C pass takes `x` with these per-channel tensors."""
    layout = _layout(x) if x.numel() >= MIN_NATIVE else None
    lib = library() if layout and _stats_ok(x.shape[1], *stats) else None
    return (lib, layout) if lib is not None else None


def fusable(x: Tensor, *stats: Tensor | None) -> bool:
    """Whether `normalise_update` takes `x` with these per-channel tensors (running mean,
    running variance, weight, bias; None where absent)."""
    return _takes(x, *stats) is not None


def normalise_update(x: Tensor, running_mean: Tensor, running_var: Tensor, momentum: float,
                     weight: Tensor | None, bias: Tensor | None, eps: float,
                     keep_old: bool = False) -> tuple[Tensor, ...] | None:
    """Eval-mode BN of `x` with the running statistics as they are, and those statistics
    then moved toward the batch's, in one read of `x`: (output in x's layout, batch mean,
    biased batch variance), and with `keep_old` the running mean and variance as they were
    (what the output was normalised by). None where the kernel does not take these tensors
    (the caller runs the two passes)."""
    takes = _takes(x, running_mean, running_var, weight, bias)
    if takes is None:
        return None
    out = torch.empty_like(x)
    return out, *_run(*takes, x, running_mean, running_var, momentum,
                      (out, weight, bias, eps), keep_old)


def _run(lib: ctypes.CDLL, layout: str, x: Tensor, running_mean: Tensor | None,
         running_var: Tensor | None, momentum: float,
         apply: tuple[Tensor, Tensor | None, Tensor | None, float] | None,
         keep_old: bool = False) -> tuple[Tensor, ...]:
    c = x.shape[1]
    move = running_mean is not None and running_var is not None
    keep_old = keep_old and move
    stats = torch.empty(4 if keep_old else 2, c)  # mean, var (, old mean, old var): one alloc
    rm = running_mean.data_ptr() if move else None
    rv = running_var.data_ptr() if move else None
    out, weight, bias, eps = apply if apply else (None, None, None, 0.0)
    tail = (out.data_ptr() if out is not None else None,
            weight.data_ptr() if weight is not None else None,
            bias.data_ptr() if bias is not None else None, eps, native.threads(x.numel()),
            stats[2].data_ptr() if keep_old else None)
    if layout == "nchw":
        failed = lib.bn_stats(x.data_ptr(), x.shape[0], c, x.numel() // (x.shape[0] * c),
                              stats[0].data_ptr(), stats[1].data_ptr(), rm, rv, momentum,
                              *tail)
    else:  # channels-last: rows of c values
        failed = lib.bn_stats_nhwc(x.data_ptr(), x.numel() // c, c, stats[0].data_ptr(),
                                   stats[1].data_ptr(), rm, rv, momentum, *tail)
    if failed:
        raise MemoryError("bn_stats could not allocate its scratch sums")
    return tuple(stats.unbind(0))

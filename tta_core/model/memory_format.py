"""The memory format a method runs its model in, chosen by measurement.

PyTorch keeps conv activations NCHW unless asked; oneDNN (x86 CPU) and cuDNN with tensor
cores run NHWC ("channels_last") convolutions faster, and NCHW convolutions with odd
channel counts (ElasticDNN's sliced surrogates) especially slowly. Measured on the 2-core
CI-class VM, 1 thread, batch 4, batch-statistics BN: the shipped small net 1.47 -> 1.00 ms,
ResNet-18 w32 at 64 px 32.0 -> 25.4 ms, torchvision ResNet-18 at 224 px 110.8 -> 75.0 ms.
Converting the weights is enough: a convolution with channels_last weights returns
channels_last activations, which the next layers keep. Values are the same up to float
summation order.

`memory_format`: "auto" (default) times a few forwards in both formats on the method's
input shape and keeps channels_last when it is at least AUTO_GAIN faster; "contiguous" and
"channels_last" force one. Models without a 2-D convolution, or "auto" without an input
shape, stay contiguous.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from tta_core.model.norms import set_bn_mode

MEMORY_FORMATS = ("auto", "contiguous", "channels_last")
AUTO_GAIN = 0.9  # channels_last must take <= this share of the contiguous forward
SLOW_MS = 100.0  # a forward slower than this: time each format once
_TORCH = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


@dataclass(frozen=True)
class FormatChoice:
    """The format a model runs in and, for "auto", the forward times that chose it."""

    format: str
    measured_ms: dict[str, float] = field(default_factory=dict)


def check_memory_format(value: object) -> str:
    """`value` if it names a format, else a one-line ValueError naming it."""
    if value not in MEMORY_FORMATS:
        raise ValueError(f"memory_format must be one of {MEMORY_FORMATS}, got {value!r}")
    return str(value)


def _has_conv2d(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def _device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


@torch.no_grad()
def time_formats(model: nn.Module, input_shape: tuple[int, ...], batch_stats: bool = False,
                 batch: int = 4, runs: int = 3, passes: int = 2) -> dict[str, float]:
    """Fastest forward (ms) of a copy of `model` in each format on a fixed random batch,
    its BN on batch statistics if `batch_stats` (as the method will run), else eval mode:
    `passes` rounds over the formats, each converting, warming twice (a fresh process
    builds its kernels over the first forwards, some taking 100x a steady one) and timing
    `runs` (one of each when a forward takes over SLOW_MS). `model` is not touched; the
    global RNG is not used."""
    probe = copy.deepcopy(model)
    set_bn_mode(probe, "batch" if batch_stats else "source")
    x = torch.randn((batch, *input_shape), generator=torch.Generator().manual_seed(0))
    x = x.to(_device(model))
    times: dict[str, list[float]] = {f: [] for f in _TORCH}
    for p in range(passes):
        for fmt in (list(_TORCH) if p % 2 == 0 else list(_TORCH)[::-1]):
            probe.to(memory_format=_TORCH[fmt])
            warm = [_forward_ms(probe, x) for _ in range(2)]
            if p == 0 and min(warm) > SLOW_MS:
                runs, passes = 1, 1  # a big model: one timed forward per format
            times[fmt] += [_forward_ms(probe, x) for _ in range(runs)]
        if p + 1 >= passes:
            break
    return {f: min(v) for f, v in times.items()}


def _forward_ms(model: nn.Module, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(x)
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return (time.perf_counter() - t0) * 1e3


def apply_memory_format(model: nn.Module, requested: str, input_shape: tuple[int, ...] = (),
                        batch_stats: bool = False) -> FormatChoice:
    """Convert `model` in place to the requested format ("auto": measured, BN as the
    method runs it: `batch_stats`) and say which."""
    requested = check_memory_format(requested)
    if not _has_conv2d(model):
        return FormatChoice("contiguous")
    measured: dict[str, float] = {}
    fmt = requested
    if requested == "auto":
        if len(input_shape) != 3:
            return FormatChoice("contiguous")
        measured = time_formats(model, tuple(input_shape), batch_stats)
        fmt = ("channels_last" if measured["channels_last"]
               <= AUTO_GAIN * measured["contiguous"] else "contiguous")
    model.to(memory_format=_TORCH[fmt])
    return FormatChoice(fmt, measured)

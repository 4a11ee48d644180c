"""Mixed precision for serving and adaptation: `precision: fp32 | fp16 | bf16`.

One rule for every method that takes a reduced precision:

- the forward (served and recorded) runs under `torch.autocast(device_type, dtype)`
  (`autocast_for`); fp32 is no autocast at all;
- what is learnt or accumulated stays fp32: BN running statistics and weights (autocast
  never changes a parameter's or buffer's dtype), losses (`fp32_logits` casts the logits
  before the entropy / KL, which are computed outside autocast), optimizer state (SGD's
  momentum buffers follow the fp32 parameters);
- the logits a step returns are fp32 (`fp32_logits`), whatever the forward ran in.

fp16 needs a CUDA device (`check_precision` refuses it elsewhere in one line); bf16 runs on
the CPU too (slowly, but for real), so CPU tests exercise the reduced-precision path.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch import Tensor

__all__ = ["DTYPES", "PRECISIONS", "autocast_for", "check_precision", "fp32_logits",
           "precision_error"]

PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16,
                                  "bf16": torch.bfloat16}


def _device(device: torch.device | str | None) -> torch.device | None:
    return None if device is None else torch.device(device)


def precision_error(precision: object, device: torch.device | str | None = None) -> str:
    """'' when `precision` is a known choice that can run on `device` (None: any device),
    else the reason in one line naming the value."""
    if not isinstance(precision, str) or precision not in PRECISIONS:
        return f"precision={precision!r} not one of {', '.join(PRECISIONS)}"
    dev = _device(device)
    if precision == "fp16" and dev is not None and dev.type != "cuda":
        return (f"precision='fp16' needs a CUDA device, got device {str(dev)!r} "
                "(use bf16 or fp32 there)")
    return ""


def check_precision(precision: object, device: torch.device | str | None = None) -> str:
    """`precision` itself when valid on `device` (see `precision_error`), else ValueError."""
    if reason := precision_error(precision, device):
        raise ValueError(reason)
    return str(precision)


def autocast_for(device: torch.device | str, precision: str, *,
                 cache_enabled: bool = True) -> AbstractContextManager:
    """The context a forward at `precision` runs in on `device`: a null context for fp32,
    else `torch.autocast(device.type, dtype)`. ValueError (one line) for an unknown value
    or fp16 off CUDA. `cache_enabled=False` for a forward captured in a CUDA graph (the
    autocast weight cache must not outlive the capture; see `runtime.graphs`)."""
    check_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[precision],
                          cache_enabled=cache_enabled)


def fp32_logits(logits: Tensor) -> Tensor:
    """`logits` in fp32 (the same tensor when it already is): what a loss reads and what a
    step returns. Differentiable, so a loss on it backpropagates into the autocast forward."""
    return logits if logits.dtype == torch.float32 else logits.float()

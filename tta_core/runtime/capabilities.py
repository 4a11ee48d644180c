"""Typed capabilities a method config can take from the runtime, so that no method copies
them: a saved-activation codec (memory budget as bit widths, DAF) for any gradient method.

A config that mixes in `MemoryOptions` gets `activation_bits` / `activation_budget_mb` /
`activation_budget_frac` / `activation_arena`; the method base class (tta_core.runtime.method)
builds the codec from them and runs its forward under it. The codec itself belongs to a paper
room (DAF); the runtime names its factory by module path (`CODEC_FACTORY`) and imports it
only when a codec is asked for, so the import layers stay papers -> runtime.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from tta_core.runtime.options import option

CODEC_FACTORY = "tta_core.daf.codecs:build_codec"


@dataclass
class MemoryOptions:
    """Saved-activation storage of an update (DAF): widths and an optional paged arena."""

    activation_bits: int | None = option(
        None, "DAF: store what the update saves for backward at 8, 4 or 2 bits (None: "
        "dense)", choices=(2, 4, 8), runtime=False)
    activation_budget_mb: float | None = option(
        None, "DAF memory budget of the saves, MiB: alone, widths 0/2/4/8 per unit are "
        "chosen per batch under it (greedy, moving-average gradient importance); with "
        "activation_bits, one paged arena of this size narrows the save worth least per "
        "byte when full; a change holds from the next batch", low=0.0, high=1e6)
    activation_budget_frac: float | None = option(
        None, "DAF memory budget of the saves as a fraction of the dense saved bytes of the "
        "batch (e.g. 0.12): widths 0/2/4/8 per unit per batch as with activation_budget_mb "
        "(with both, the smaller budget holds); not with activation_bits", low=0.0, high=1.0)
    activation_arena: bool = option(
        False, "DAF with dynamic widths (a budget without activation_bits): the quantized "
        "saves live in one preallocated paged arena sized per batch to the budget less "
        "what it does not hold (ReLU masks, pooling indices); a save the widths "
        "mis-predicted is narrowed in the forward (Algorithm 3)", runtime=False)


@runtime_checkable
class StepCodec(Protocol):
    """A saved-tensor codec a method's forward runs under (a context manager), with what
    one step stored (`stats`), a hook after the backward (`after_backward`) and one in
    the plan phase before the forward (`before_forward`: widths for this batch)."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...

    def stats(self) -> dict[str, float | int | bool]: ...

    def after_backward(self, model: nn.Module) -> None: ...

    def before_forward(self, x: Tensor) -> None: ...


def build_codec(model: nn.Module, options: object) -> StepCodec | None:
    """The codec a MemoryOptions config asks for; None for dense saves or a config without
    the capability (a method that plans its own codec per batch, SURGEON, has none)."""
    if not isinstance(options, MemoryOptions):
        return None
    bits, budget = options.activation_bits, options.activation_budget_mb
    if bits is None and budget is None and options.activation_budget_frac is None \
            and not options.activation_arena:
        return None
    module, _, name = CODEC_FACTORY.partition(":")
    return getattr(importlib.import_module(module), name)(model, options)

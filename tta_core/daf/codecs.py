"""DAF's codec for any gradient method (the runtime's `StepCodec`, built from a config's
MemoryOptions by tta_core.runtime.capabilities.build_codec).

- `activation_bits` alone: the adaptation forward runs under the activation codec with a
  uniform width (`tta_core.memory.widths.daf_plan`): frozen conv/linear inputs are not
  stored (nothing reads them when only norm affines train), BN inputs are per-group
  min-max quantized at that width and bit-packed, ReLU outputs kept as exact 1-bit masks.
- with `activation_budget_mb` (§3.4.2-3.4.4): the quantized saves live in one preallocated
  paged arena of that many MiB (`arena.PagedArena`); when it is full, the save worth least
  per byte is narrowed a width (8 -> 4 -> 2 bits, never dropped), the new one included. A
  unit's worth is the RMS of its parameters' gradient in the previous step (SURGEON Eq. 4;
  1.0 before the first). What the arena cannot hold even at 2 bits is kept outside and
  reported (`arena_overflow_bytes`); the 1-bit ReLU masks are not in the arena. A budget
  changed at run time resizes the arena before the next forward (§3.4.4).
- `activation_budget_mb` and/or `activation_budget_frac` (a fraction of the batch's dense
  saved bytes) without `activation_bits`: dynamic widths (`dynamic.DynamicWidths`): per
  batch, 0/2/4/8 bits per unit from the greedy knapsack under the budget, importance a
  moving average; with `activation_arena` their quantized saves live in a paged arena
  resized per batch to the budget less the bytes it does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from tta_core.daf.arena import PagedArena
from tta_core.daf.arena_codec import ARENA_PAGE_BYTES, ArenaCodec, arena_stats
from tta_core.daf.dynamic import DynamicWidths, budget_bytes
from tta_core.memory import ActivationCodec
from tta_core.memory.ledger import MIB
from tta_core.memory.widths import check_activation_bits, daf_plan
from tta_core.runtime.stats import gradient_rms


@dataclass
class DafCodec:
    """An activation codec (plain or over a paged arena) with the runtime's StepCodec
    hooks: what one step stored, and the gradient importance the arena ranks by."""

    codec: ActivationCodec
    options: object = None  # the config: a changed budget resizes the arena

    def before_forward(self, x: Tensor) -> None:
        """Resize the arena when the config's budget changed since the last forward."""
        if not isinstance(self.codec, ArenaCodec) or self.options is None:
            return
        budget = _check_budget(getattr(self.options, "activation_budget_mb", None))
        if int(budget * MIB) != self.codec.arena.budget:
            for key in list(self.codec.arena.table):
                self.codec.arena.remove(key)
            self.codec.arena.resize(int(budget * MIB))

    def __enter__(self) -> DafCodec:
        self.codec.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.codec.__exit__(*exc)

    def stats(self) -> dict[str, float | int | bool]:
        """saved_bytes of the step, and the arena's figures when there is one."""
        out: dict[str, float | int | bool] = {}
        if self.codec.result is not None:
            out["saved_bytes"] = self.codec.result.total
        if isinstance(self.codec, ArenaCodec):
            out.update(arena_stats(self.codec))
        return out

    def after_backward(self, model: nn.Module) -> None:
        """The arena ranks the next step's saves by this step's gradients."""
        if isinstance(self.codec, ArenaCodec):
            self.codec.importance.update(unit_importance(model))


def _check_budget(budget_mb: object) -> float:
    if isinstance(budget_mb, bool) or not isinstance(budget_mb, int | float) \
            or not 0 < budget_mb < 1e6:
        raise ValueError(f"activation_budget_mb must be a number in (0, 1e6) MiB, got "
                         f"{budget_mb!r}")
    return float(budget_mb)


def build_codec(model: nn.Module, options: object) -> DafCodec | DynamicWidths:
    """The DAF codec a config's `activation_bits` (8/4/2) and `activation_budget_mb` ask
    for (module doc); ValueError naming a bad width or budget. Both are read again before
    each forward where they can change (the budget)."""
    bits = getattr(options, "activation_bits", None)
    budget_mb = getattr(options, "activation_budget_mb", None)
    if getattr(options, "activation_arena", False) and budget_mb is None \
            and getattr(options, "activation_budget_frac", None) is None:
        raise ValueError("activation_arena needs a budget (activation_budget_mb or "
                         "activation_budget_frac), got neither")
    if bits is None:
        budget_bytes(options, 1)  # the values alone; the dense bytes come per batch
        return DynamicWidths(model, options)
    if getattr(options, "activation_budget_frac", None) is not None:
        raise ValueError("activation_budget_frac takes no activation_bits (widths are chosen "
                         f"per batch), got activation_bits={bits!r}")
    check_activation_bits(bits)
    if budget_mb is None:
        return DafCodec(ActivationCodec(model, daf_plan(model, bits)))
    arena = PagedArena(int(_check_budget(budget_mb) * MIB), page_size=ARENA_PAGE_BYTES)
    return DafCodec(ArenaCodec(model, daf_plan(model, bits), arena), options)


def unit_importance(model: nn.Module) -> dict[str, float]:
    """RMS gradient of each module with trainable parameters (as SURGEON's Eq. 4)."""
    out = {}
    for name, mod in model.named_modules():
        grads = [p.grad for p in mod.parameters(recurse=False) if p.grad is not None]
        if grads:
            out[name] = gradient_rms(grads)
    return out

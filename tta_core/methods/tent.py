"""Tent: test entropy minimisation over the affine parameters of the norm layers.

Wang et al., "Tent: Fully Test-Time Adaptation by Entropy Minimization", ICLR 2021.
Adapts the weight/bias of BatchNorm, LayerNorm and GroupNorm layers, as the peer code
does (DequanWang/tent, mariodoebler/test-time-adaptation), so LayerNorm-only models
(ViT) adapt too. Sequential mode (AdaShadow §2.2): forward, backward, SGD step, then a
reforward of the same batch with the updated model, whose logits are the prediction
(configurable).

`activation_bits` (8/4/2; DAF, tta_core.daf.plans): the adaptation forward runs under the
activation codec: the frozen conv/linear layers' inputs are not stored at all (nothing
reads them: tent updates norm affine parameters only), BN inputs are stored per-group
min-max quantized at that width and bit-packed, ReLU outputs as exact 1-bit masks.
Measured saved bytes go to StepResult.stats["saved_bytes"].

`activation_budget_mb` (with activation_bits; DAF §3.4.2-3.4.4): the quantized saves live in
one preallocated paged arena of that many MiB (tta_core.daf.arena, ArenaCodec); when it
is full, the save worth least per byte is downgraded a width (8 -> 4 -> 2 bits, never
dropped: autograd already holds it), the new one included. A unit's worth is the RMS of its
parameters' gradient in the previous step (SURGEON Eq. 4; 1.0 before the first). What the
arena cannot hold even at 2 bits is kept outside and reported (`arena_overflow_bytes`); the
1-bit ReLU masks are not in the arena (`saved_bytes` counts everything).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tta_core.api import PhaseClock, StepResult
from tta_core.memory import ActivationCodec
from tta_core.daf.arena import PagedArena
from tta_core.daf.arena_codec import ArenaCodec
from tta_core.daf.plans import check_activation_bits, daf_plan
from tta_core.surgeon.layer_importance import gradient_importance
from tta_core.memory.ledger import MIB
from tta_core.registry import register
from tta_core.runtime.method import MethodConfig, TTAMethod


@dataclass
class TentConfig(MethodConfig):
    """Tent settings; `reforward=False` returns the pre-update logits (original Tent)."""

    reforward: bool = True
    activation_bits: int | None = None  # DAF: store saved activations at 8/4/2 bits
    activation_budget_mb: float | None = None  # DAF's paged arena for them, MiB (module doc)


@register("tent")
class Tent(TTAMethod):
    """Entropy minimisation on norm-layer weight/bias; BN uses batch statistics."""

    config_cls = TentConfig

    def configure_model(self) -> None:
        super().configure_model()
        self.train_norm_affine()
        bits = getattr(self.config, "activation_bits", None)  # subclasses' configs may lack it
        budget = getattr(self.config, "activation_budget_mb", None)
        if bits is not None:
            check_activation_bits(bits)
        self._codec = (ActivationCodec(self.model, daf_plan(self.model, bits))
                       if bits is not None and budget is None else None)
        if budget is not None:
            self._codec = arena_codec(self.model, bits, budget)

    def forward_and_adapt(self, x: Tensor) -> StepResult:
        clock = PhaseClock.for_tensor(x)
        codec = self._codec
        with torch.enable_grad():
            if codec is None:
                logits = self.model(x)
            else:
                with codec:
                    logits = self.model(x)
            loss = self.loss(logits)
        forward_ms = clock.mark()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        backward_ms = clock.mark()
        out = self.reforward(x, logits, self.config.reforward)
        res = self.result(out, forward_ms, backward_ms, clock.mark(),
                          loss=float(loss.detach()), adapted=True,
                          units_updated=len(self.params) // 2)
        if codec is not None and codec.result is not None:
            res.stats["saved_bytes"] = codec.result.total
        if isinstance(codec, ArenaCodec):
            res.stats.update(arena_stats(codec))
            codec.importance.update(unit_importance(self.model))
        return res


def arena_codec(model: torch.nn.Module, bits: int | None, budget_mb: float) -> ArenaCodec:
    """The DAF codec over a paged arena of `budget_mb` MiB (pages of 4 KiB: camera-sized
    activations are small); ValueError naming a bad budget or a missing width."""
    if bits is None:
        raise ValueError(f"activation_budget_mb={budget_mb!r} needs activation_bits (8/4/2): "
                         "the arena holds quantized saves")
    if isinstance(budget_mb, bool) or not isinstance(budget_mb, int | float) \
            or not 0 < budget_mb < 1e6:
        raise ValueError(f"activation_budget_mb must be a number in (0, 1e6) MiB, got "
                         f"{budget_mb!r}")
    arena = PagedArena(int(budget_mb * MIB), page_size=4096)
    return ArenaCodec(model, daf_plan(model, bits), arena)


def unit_importance(model: torch.nn.Module) -> dict[str, float]:
    """RMS gradient of each module with trainable parameters (SURGEON Eq. 4)."""
    out = {}
    for name, mod in model.named_modules():
        grads = [p.grad for p in mod.parameters(recurse=False) if p.grad is not None]
        if grads:
            out[name] = gradient_importance(grads)
    return out


def arena_stats(codec: ArenaCodec) -> dict[str, float | int | bool]:
    """What the arena holds after the step's forward, what overflowed, whether it held."""
    arena = codec.arena
    widths = [b.bits for b in arena.table.values()]
    return {"arena_bytes": arena.used_bytes, "arena_overflow_bytes": codec.overflow_bytes,
            "arena_budget_bytes": arena.budget, "arena_entries": len(widths),
            "arena_min_bits": min(widths, default=0),
            "within_arena_budget": arena.used_bytes <= arena.budget
            and codec.overflow_bytes == 0}

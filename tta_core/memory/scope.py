"""Which unit is running, and what a tensor autograd saves is for (module hooks).

Saved-tensor hooks only see a tensor. To attribute it and to pick an encoding, UnitScope
installs forward pre/post hooks on the decomposed units' modules (conv, linear, bn, ln, gn,
attn) and on the activation modules (nn.ReLU, nn.ReLU6 / nn.Hardtanh) and keeps a stack of
the modules running now. A saved tensor is then:

- ``wgrad``: saved while a conv/linear unit's module runs and it *is* that module's input
  (same data pointer and element count; a 2-D view of a linear's 3-D input counts): what the
  layer keeps for ∂W (∂x needs only the weight).
- ``act``: saved while an activation module runs: its result (in-place) or input, of which
  the backward reads only which entries lie strictly inside (min, max).
- ``other``: anything else (BN inputs and statistics, pooling inputs and indices, ...).
  ``SaveSite.input_of`` marks the input of a running BN/LN/GN unit ("bn"/"ln"/"gn") and of a
  max-pool module ("pool": its backward reads only the indices and the input's shape).

**Attribution to a unit**: a save belongs to the unit whose module started last, i.e. to the
saves made while that unit's module runs *plus* those of the non-parameterised ops after it
up to the start of the next unit (a BN unit owns the ReLU after it; a ResNet block's last BN
owns the residual add and ReLU). Saves before the first unit go to ``BEFORE_UNITS``.
An attention module is attributed to its first unit (``.in_proj``): its out-projection runs
inside the same module call. Parameters and buffers are model state, never counted.
Hooks from other threads are ignored (AdaShadow's background update may run the model).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tta_core.model.units import StagedModel

BEFORE_UNITS = "<before first unit>"
WGRAD, ACT, OTHER = "wgrad", "act", "other"
ROLES = (WGRAD, ACT, OTHER)
_WGRAD_KINDS = ("conv", "linear")
_INPUT_KINDS = ("bn", "ln", "gn", "pool")  # classify marks their inputs (SaveSite.input_of)
_POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d)


@dataclass(frozen=True)
class SaveSite:
    """Where a saved tensor comes from: its unit, its role and (for ``act``) the band."""

    unit: str
    role: str
    band: tuple[float, float] = (0.0, float("inf"))  # backward reads lo < x < hi
    input_of: str = ""  # "bn" / "ln" / "gn" / "pool": the input of such a running module


@dataclass
class _Frame:
    kind: str
    ptr: int
    numel: int
    band: tuple[float, float]


def activation_band(mod: nn.Module) -> tuple[float, float] | None:
    """(lo, hi) whose strict interior the backward of `mod` passes; None if not handled."""
    if isinstance(mod, nn.ReLU):
        return (0.0, float("inf"))
    if isinstance(mod, nn.Hardtanh):  # includes nn.ReLU6
        return (float(mod.min_val), float(mod.max_val))
    return None


def _module_kind(mod: nn.Module) -> str:
    for cls, kind in ((nn.MultiheadAttention, "attn"), (nn.Conv1d | nn.Conv2d | nn.Conv3d, "conv"),
                      (nn.Linear, "linear"), (nn.modules.batchnorm._BatchNorm, "bn"),
                      (nn.LayerNorm, "ln"), (nn.GroupNorm, "gn")):
        if isinstance(mod, cls):
            return kind
    return "other"


UnitRow = tuple[str, nn.Module, str]  # unit name, module, kind


def unit_table(target: StagedModel | nn.Module) -> tuple[nn.Module, list[UnitRow]]:
    """(model, units): a StagedModel's units, or for a plain module every submodule that
    owns parameters directly (named_modules order; kind "other" if not conv/linear/bn/ln/gn)."""
    if isinstance(target, StagedModel):
        return target.model, [(u.name, u.module, u.kind) for u in target.units]
    if not isinstance(target, nn.Module):
        raise TypeError(f"expected a StagedModel or nn.Module, got {type(target).__name__}")
    owners = [(n, m, _module_kind(m)) for n, m in target.named_modules()
              if next(m.parameters(recurse=False), None) is not None]
    return target, owners


class UnitScope:
    """Forward hooks that track the running unit; classify() names a saved tensor's site."""

    def __init__(self, target: StagedModel | nn.Module) -> None:
        self.model, self.units = unit_table(target)
        self._units: dict[int, tuple[str, str]] = {}
        for name, mod, kind in reversed(self.units):  # attention module: its first unit
            self._units[id(mod)] = (name, kind)
        self._acts = [(m, b) for m in self.model.modules()
                      if (b := activation_band(m)) is not None]
        self._pools = [m for m in self.model.modules() if isinstance(m, _POOLS)]
        self.unit_names = [name for name, _m, _k in self.units]
        self._handles: list = []
        self._state: set[int] = set()
        self._tid = 0
        self.reset()

    def reset(self) -> None:
        """Forget the last forward: current unit, module stack, counters."""
        self.current = BEFORE_UNITS
        self._stack: list[_Frame] = []
        self.units_started = 0
        self.wgrad_inputs: dict[str, int] = defaultdict(int)  # analytic bytes per unit

    def install(self) -> None:
        """Register the module hooks (for the calling thread) and snapshot model state."""
        if self._handles:
            raise RuntimeError("UnitScope hooks are already installed")
        self.reset()
        self._tid = threading.get_ident()
        self._state = {t.untyped_storage().data_ptr()
                       for t in (*self.model.parameters(), *self.model.buffers())}
        for name, mod, kind in self.units:
            if self._units[id(mod)][0] != name:
                continue  # second unit of an attention module: hooked once
            self._hook(mod, name, kind, (0.0, float("inf")))
        for mod, band in self._acts:
            self._hook(mod, None, "act", band)
        for mod in self._pools:
            self._hook(mod, None, "pool", (0.0, float("inf")))

    def _hook(self, mod: nn.Module, unit: str | None, kind: str,
              band: tuple[float, float]) -> None:
        def pre(_m: nn.Module, args: tuple) -> None:
            if threading.get_ident() != self._tid:
                return
            x = args[0] if args and isinstance(args[0], Tensor) else None
            if unit is not None:
                self.current = unit
                self.units_started += 1
                if x is not None and kind in _WGRAD_KINDS and torch.is_grad_enabled():
                    self.wgrad_inputs[unit] += x.numel() * x.element_size()
            ptr, numel = (x.data_ptr(), x.numel()) if x is not None else (0, -1)
            self._stack.append(_Frame(kind, ptr, numel, band))

        def post(_m: nn.Module, _args: tuple, _out: object) -> None:
            if threading.get_ident() == self._tid and self._stack:
                self._stack.pop()

        self._handles.append(mod.register_forward_pre_hook(pre))
        self._handles.append(mod.register_forward_hook(post))

    def remove(self) -> None:
        """Remove the module hooks (the counters stay readable)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def is_state(self, t: Tensor) -> bool:
        """True for parameters and buffers (and views of them): never counted or encoded."""
        return t.untyped_storage().data_ptr() in self._state

    def classify(self, t: Tensor) -> SaveSite:
        """The site of a tensor being saved now (call from a pack hook)."""
        top = self._stack[-1] if self._stack else None
        if top is None:
            return SaveSite(self.current, OTHER)
        if top.kind == "act":
            return SaveSite(self.current, ACT, top.band)
        own = t.data_ptr() == top.ptr and t.numel() == top.numel
        if top.kind in _WGRAD_KINDS and own:
            return SaveSite(self.current, WGRAD)
        if top.kind in _INPUT_KINDS and own and t.is_floating_point():
            return SaveSite(self.current, OTHER, input_of=top.kind)
        return SaveSite(self.current, OTHER)

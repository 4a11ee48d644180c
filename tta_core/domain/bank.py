"""Per-domain adapted state, swapped into the live model by copying (no rebuild).

The state of a domain is what DARDA's sub-network holds: the BatchNorm affine weights and
biases (and running statistics, when BN normalises with them) of the adapted layers, and
the final linear layer. `adapted_tensors` names the live tensors (parameters and buffers of
the model itself); `StateBank.activate(name)` copies the live values into the outgoing
domain's slots and the incoming domain's values into the live tensors with `copy_`: O(state
size), the model's parameters keep their identity (optimizers and hooks stay valid).

A new domain starts from a copy of another domain's state (the nearest known one, by the
caller's choice) or of the source state captured at construction. At most `capacity`
domains are kept; adding one more drops the least recently activated (LRU). The source
state is never dropped.

Optimizer state is *not* banked: the caller resets it on a swap (darda: SGD momentum is
cleared). Momentum points along the previous domain's gradients, keeping it per domain
would double the bank, and a domain that is revisited is served forward-only once stable,
where a stored momentum would be stale anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

SOURCE = "source"


def last_linear(model: nn.Module) -> str:
    """Name of the model's last nn.Linear (the classifier), '' when there is none."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    return names[-1] if names else ""


def adapted_tensors(model: nn.Module, skip: Callable[[str], bool] = lambda _n: False,
                    classifier: bool = True) -> dict[str, Tensor]:
    """Live tensors of the adapted state, by state_dict name: affine params and running
    stats (where tracked) of every BatchNorm whose module name `skip` does not reject,
    then the last linear layer's weight and bias (`classifier`)."""
    out: dict[str, Tensor] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, _BatchNorm) or skip(name):
            continue
        for key in ("weight", "bias", "running_mean", "running_var"):
            t = getattr(mod, key, None)
            if isinstance(t, Tensor):
                out[f"{name}.{key}"] = t
    fc = last_linear(model) if classifier else ""
    if fc:
        lin = model.get_submodule(fc)
        out[f"{fc}.weight"] = lin.weight
        if lin.bias is not None:
            out[f"{fc}.bias"] = lin.bias
    return out


def _copy(dst: Iterable[Tensor], src: Iterable[Tensor]) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


class StateBank:
    """Domain name -> copy of the adapted state; one domain is live in the model."""

    def __init__(self, live: dict[str, Tensor], capacity: int = 32,
                 source: dict[str, Tensor] | None = None) -> None:
        """`source`: the source state (default: a copy of the live tensors now)."""
        if not live:
            raise ValueError("state bank needs at least one live tensor")
        if capacity < 1:
            raise ValueError(f"bank capacity must be >= 1, got {capacity}")
        self.live = dict(live)
        self.capacity = int(capacity)
        src = self.live if source is None else source
        self.source = {k: src[k].detach().clone() for k in self.live}
        self.states: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        self.active = SOURCE  # what the live tensors hold

    @property
    def names(self) -> list[str]:
        """Banked domains, least recently activated first."""
        return list(self.states)

    def state_bytes(self) -> int:
        """Bytes of one domain's state."""
        return sum(t.numel() * t.element_size() for t in self.live.values())

    def get(self, name: str) -> dict[str, Tensor]:
        """The stored state of `name` (the source for 'source'); the live values for the
        active domain are only stored by `store_active`."""
        if name == SOURCE:
            return self.source
        if name not in self.states:
            raise ValueError(f"unknown domain {name!r}; banked: {self.names}")
        return self.states[name]

    def store_active(self) -> None:
        """Copy the live tensors into the active domain's slots (not for the source)."""
        if self.active != SOURCE:
            _copy(self.states[self.active].values(), self.live.values())

    def add(self, name: str, init_from: str = SOURCE) -> str:
        """Bank `name` as a copy of `init_from`'s state; returns the evicted name or ''."""
        if name == SOURCE or name in self.states:
            raise ValueError(f"domain {name!r} is already in the bank")
        if init_from == self.active:
            self.store_active()
        src = self.get(init_from)
        evicted = ""
        if len(self.states) >= self.capacity:
            evicted = next(n for n in self.states if n != self.active)
            self.drop(evicted)
        self.states[name] = {k: v.detach().clone() for k, v in src.items()}
        return evicted

    def activate(self, name: str, init_from: str = SOURCE) -> str:
        """Make `name` live (banking it first from `init_from` if new); stores the outgoing
        domain's live values. Returns the evicted name or ''."""
        if name == self.active:
            return ""
        evicted = "" if name == SOURCE or name in self.states else self.add(name, init_from)
        self.store_active()
        _copy(self.live.values(), self.get(name).values())
        self.active = name
        if name != SOURCE:
            self.states.move_to_end(name)
        return evicted

    def drop(self, name: str) -> None:
        """Forget `name` (not the active domain nor the source)."""
        if name == self.active or name == SOURCE:
            raise ValueError(f"cannot drop the {'active' if name == self.active else 'source'} "
                             f"domain {name!r}")
        self.states.pop(name, None)

    def load(self, name: str, state: dict[str, Tensor]) -> None:
        """Bank `state` (e.g. from a file) under `name`; keys and shapes must match."""
        if set(state) != set(self.live):
            raise ValueError(f"state of {name!r} has keys {sorted(set(state) ^ set(self.live))} "
                             "that the model's adapted state does not (or lacks them)")
        for k, v in self.live.items():
            if tuple(state[k].shape) != tuple(v.shape):
                raise ValueError(f"state of {name!r}: {k} has shape {tuple(state[k].shape)}, "
                                 f"the model's has {tuple(v.shape)}")
        self.states[name] = {k: state[k].to(v.dtype).clone() for k, v in self.live.items()}
        if name == self.active:
            _copy(self.live.values(), self.states[name].values())

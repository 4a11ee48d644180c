"""DAF's dynamic widths for any gradient method (§3.4.1 + Algorithm 3's moving average):
per batch, each unit's saves get a width in {0, 2, 4, 8} bits from the greedy knapsack
(bit_alloc.greedy_bits) under the method's memory budget (`activation_budget_mb`, read
before every forward, so a change made at run time holds from the next batch on).

Costs: bytes per unit and width from one profiled forward of a 2-sample slice per input
shape (BN running statistics restored afterwards), scaled to the batch
(`batch_profile`): an upper bound, since per-group overheads only round up and shared saves
are charged to every unit that saves them. What no width changes (ReLU masks, pooling
indices, BN statistics, frozen units' inputs, which are not stored) is charged first.

Widths: a trainable conv/linear unit stores its input at 0 (not stored: the unit is frozen
for this batch, no ∂W), 2, 4 or 8 bits; a norm unit (BN/LN) its input at 2, 4 or 8 (its ∂x
needs it: never 0). A norm unit's width sets the error of the ∂x it sends to every unit
before it, so its importance is its own plus that of every trainable unit before it in
forward order (`unit_values`).

Importance (Algorithm 3's MA_i; the paper leaves the metric open): an exponential moving
average of the unit's squared gradient norm, i.e. SURGEON's Eq. 4 statistic G_i squared
times the entry count, so that each unit weighs by its share of the whole gradient (what a
gradient cosine measures). Before a unit's first gradient it is the largest known one (1.0
when none is known): a unit never measured is given bits so that it gets measured. A unit
frozen by a 0-bit width keeps its last average.

Value of a width (`FIDELITY`): the share of a unit's gradient energy it keeps, cos² with
cos the per-layer gradient cosine measured at that width (ResNet-18, all parameters,
per-group 128 min-max: 2 bits 0.948, 4 bits 0.998, 8 bits 0.99999; 0 bits keeps nothing).
bit_alloc's default table (2 bits: 0.6) makes freezing look cheap: on ResNet-18 64 px at
12 % it froze conv1, half the gradient energy, and the cosine to dense fell to 0.57.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tta_core.daf.bit_alloc import Allocation, UnitChoice, greedy_bits
from tta_core.memory import ActivationCodec, CodecPlan, SaveProfile, predicted_bytes
from tta_core.memory.ledger import MIB, SaveEvent
from tta_core.memory.predict import profile_saves
from tta_core.memory.quant import MIN_QUANT_NUMEL, NORM_KINDS, quant_nbytes
from tta_core.memory.scope import OTHER, WGRAD, unit_table
from tta_core.runtime import losses

WGRAD_WIDTHS = (0, 2, 4, 8)
NORM_WIDTHS = (2, 4, 8)
FIDELITY = {0: 0.0, 2: 0.90, 4: 0.996, 8: 1.0}
PROFILE_SAMPLES = 2  # BatchNorm1d needs > 1 value per channel
GROUP = 128


@dataclass
class WidthState:
    """The widths one batch ran with and what they were predicted to cost."""

    bits: dict[str, int] = field(default_factory=dict)
    budget_bytes: int = 0
    predicted_bytes: int = 0
    fits: bool = True  # the lowest widths fit the budget (else they are used anyway)
    frozen_units: int = 0


def batch_profile(model: nn.Module, x: Tensor) -> SaveProfile:
    """The saves of a forward on x's batch, profiled on its first PROFILE_SAMPLES samples
    and scaled up (module doc); the model's BN running statistics are left unchanged."""
    n = min(PROFILE_SAMPLES, int(x.shape[0]))
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    try:
        prof = profile_saves(model, x[:n].detach(), losses.entropy_loss)
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
    scale = math.ceil(int(x.shape[0]) / n)
    events = [dataclasses.replace(e, numel=e.numel * scale,
                                  storage_nbytes=e.storage_nbytes * scale)
              for e in prof.events]
    return SaveProfile(events, prof.unit_names, tuple(x.shape), prof.unit_kinds)


def _varying(e: SaveEvent, kind: str) -> bool:
    """Whether a save's bytes follow its unit's width (what the codec quantizes)."""
    if kind in NORM_KINDS:
        return e.role == OTHER and e.floating and e.numel >= MIN_QUANT_NUMEL
    return e.role == WGRAD


def unit_costs(profile: SaveProfile, widths: Mapping[str, tuple[int, ...]],
               fixed_bits: Mapping[str, int]) -> tuple[dict[str, dict[int, float]], int]:
    """(bytes per width of each unit in `widths`, bytes no width changes; `fixed_bits`:
    the widths of the other units, e.g. 0 for frozen conv/linear units)."""
    seen: set[tuple] = set()
    numels: dict[str, list[int]] = {u: [] for u in widths}
    for e in profile.events:
        kind = profile.unit_kinds.get(e.unit, "")
        if e.unit in widths and _varying(e, kind) and (e.unit, e.view) not in seen:
            seen.add((e.unit, e.view))
            numels[e.unit].append(e.numel)
    mem = {u: {b: float(sum(quant_nbytes(n, b, GROUP) for n in numels[u])) for b in ws}
           for u, ws in widths.items()}
    low = _plan({**fixed_bits, **{u: min(ws) for u, ws in widths.items()}})
    fixed = predicted_bytes(profile, low).total - sum(mem[u][min(ws)]
                                                      for u, ws in widths.items())
    return mem, max(0, fixed)


def unit_values(order: list[str], kinds: Mapping[str, str], ma: Mapping[str, float]
                ) -> dict[str, float]:
    """Importance per unit in forward `order`: its own average, plus for a norm unit the
    averages of every unit before it (module doc)."""
    known = [v for v in ma.values() if v > 0]
    default = max(known) if known else 1.0
    own = {u: ma.get(u, default) for u in order}
    out, before = {}, 0.0
    for u in order:
        out[u] = own[u] + (before if kinds[u] in NORM_KINDS else 0.0)
        before += own[u]
    return out


def budget_bytes(options: object) -> int:
    """The options' `activation_budget_mb` in bytes; ValueError naming a bad value."""
    mb = getattr(options, "activation_budget_mb", None)
    if isinstance(mb, bool) or not isinstance(mb, int | float) or not 0 < mb < 1e6:
        raise ValueError(f"activation_budget_mb must be a number in (0, 1e6) MiB, got {mb!r}")
    return int(mb * MIB)


def _plan(bits: Mapping[str, int]) -> CodecPlan:
    """The codec plan of these widths; other norm units' inputs at 8 bits, ReLU masks."""
    return CodecPlan(bits=dict(bits), norm_bits=8, group=GROUP, narrow_ints=True)


class DynamicWidths:
    """StepCodec of dynamic DAF widths under `options.activation_budget_mb` (module doc)."""

    def __init__(self, model: nn.Module, options: object, ema: float = 0.9) -> None:
        self.model, self.options, self.ema = model, options, ema
        rows = unit_table(model)[1]
        self._kinds = {n: k for n, _m, k in rows}
        self._params = {n: list(m.parameters(recurse=False)) for n, m, _k in rows}
        self.ma: dict[str, float] = {}
        self._costs: dict[tuple, tuple[dict[str, dict[int, float]], int, list[str]]] = {}
        self.state = WidthState()
        self.codec: ActivationCodec | None = None
        self._frozen: list[nn.Parameter] = []

    def _widths(self) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
        """(allowed widths of each unit with a trainable parameter, 0 bits for the frozen
        conv/linear units: backward never reads their input)."""
        out, frozen = {}, {}
        for n, ps in self._params.items():
            wgrad = self._kinds[n] in ("conv", "linear")
            if not any(p.requires_grad for p in ps):
                if wgrad:
                    frozen[n] = 0
            elif self._kinds[n] in NORM_KINDS:
                out[n] = NORM_WIDTHS
            elif wgrad:
                out[n] = WGRAD_WIDTHS
        return out, frozen

    def before_forward(self, x: Tensor) -> None:
        """Choose this batch's widths (greedy knapsack under the current budget) and
        freeze the units given 0 bits until the forward ends."""
        widths, frozen = self._widths()
        key = (tuple(x.shape), tuple(widths))
        if key not in self._costs:
            prof = batch_profile(self.model, x)
            mem, fixed = unit_costs(prof, widths, frozen)
            order = [u for u in prof.unit_names if u in widths]
            self._costs[key] = (mem, fixed, order)
        mem, fixed, order = self._costs[key]
        budget = budget_bytes(self.options)
        values = unit_values(order, self._kinds, self.ma)
        choices = [UnitChoice(u, values[u], mem[u]) for u in order]
        alloc, fits = self._allocate(choices, budget - fixed)
        self.state = WidthState(alloc.bits, budget, int(fixed + alloc.mem), fits,
                                sum(1 for b in alloc.bits.values() if b == 0))
        self._frozen = [p for u, b in alloc.bits.items() if b == 0
                        for p in self._params[u] if p.requires_grad]
        for p in self._frozen:
            p.requires_grad_(False)
        self.codec = ActivationCodec(self.model, _plan({**frozen, **alloc.bits}))

    @staticmethod
    def _allocate(choices: list[UnitChoice], budget: float) -> tuple[Allocation, bool]:
        """The greedy widths; the lowest widths when even they do not fit (reported)."""
        try:
            return greedy_bits(choices, budget, fidelity=FIDELITY), True
        except ValueError:
            low = {c.name: min(c.mem) for c in choices}
            return Allocation(low, 0.0, sum(c.mem[low[c.name]] for c in choices), 0.0), False

    def __enter__(self) -> DynamicWidths:
        if self.codec is None:
            raise RuntimeError("DynamicWidths: before_forward(x) must run before the forward")
        self.codec.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.codec is not None
        self.codec.__exit__(*exc)
        for p in self._frozen:  # the recorded graph keeps them frozen for this batch
            p.requires_grad_(True)
        self._frozen = []

    def after_backward(self, model: nn.Module) -> None:
        """MA_i update from this step's gradients (units that had one)."""
        for u, ps in self._params.items():
            grads = [p.grad for p in ps if p.grad is not None]
            if not grads:
                continue
            energy = sum(float(torch.linalg.vector_norm(g.detach())) ** 2 for g in grads)
            old = self.ma.get(u)
            self.ma[u] = energy if old is None else self.ema * old + (1 - self.ema) * energy

    def stats(self) -> dict[str, float | int | bool]:
        """Saved bytes measured, budget, whether it held, the widths' spread."""
        s = self.state
        saved = self.codec.result.total if self.codec is not None and self.codec.result else 0
        widths = list(s.bits.values()) or [0]
        return {"saved_bytes": saved, "width_budget_bytes": s.budget_bytes,
                "width_predicted_bytes": s.predicted_bytes,
                "within_width_budget": saved <= s.budget_bytes and s.fits,
                "width_frozen_units": s.frozen_units,
                "width_mean_bits": sum(widths) / len(widths),
                **{f"width_units_{b}bit": widths.count(b) for b in WGRAD_WIDTHS}}

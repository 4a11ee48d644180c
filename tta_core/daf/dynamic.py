"""DAF's dynamic widths for any gradient method (§3.4.1 + Algorithm 3's moving average):
per batch, each unit's saves get a width in {0, 2, 4, 8} bits from the greedy knapsack
(bit_alloc.greedy_bits) under the method's memory budget (`activation_budget_mb`, and/or
`activation_budget_frac` times the batch's dense saved bytes, `dense_bytes`; read before
every forward, so a change made at run time holds from the next batch on).

Costs: bytes per unit and width from one profiled forward of a 2-sample slice per input
shape (BN running statistics restored afterwards), scaled to the batch
(`batch_profile`): an upper bound, since per-group overheads only round up and shared saves
are charged to every unit that saves them. What no width changes (ReLU masks, pooling
indices, BN statistics, frozen units' inputs, which are not stored) is charged first.

Widths: a trainable conv/linear unit stores its input at 0 (not stored: the unit is frozen
for this batch, no ∂W), 2, 4 or 8 bits; a norm unit (BN/LN) its input at 2, 4 or 8 (its ∂x
needs it: never 0). A norm unit's width also sets the error of the ∂x it sends to every
unit before it, so its importance is its own plus that of every trainable unit before it in
forward order, each part valued by its own table (`unit_choices`, below). A frozen norm unit
(SAR's layer4, a unit SURGEON froze) gets a width too, valued by the units before it only.
Widths are planned after the method's `prepare` (what trains this batch) and hold for every
recorded forward until the next batch (SAR's two SAM forwards; `saved_bytes`: the larger).

Importance (Algorithm 3's MA_i; the paper leaves the metric open): an exponential moving
average of the unit's squared gradient norm, i.e. SURGEON's Eq. 4 statistic G_i squared
times the entry count, so that each unit weighs by its share of the whole gradient (what a
gradient cosine measures). Before a unit's first gradient it is the largest known one (1.0
when none is known): a unit never measured is given bits so that it gets measured. A unit
frozen by a 0-bit width keeps its last average.

Value of a width: the share of a gradient's energy it keeps, 1 - (relative squared error)
of that gradient with only this unit's save quantized (ResNet-50 224 px b4 and ResNet-18,
per-group 128 min-max; 0 bits keeps nothing):
- `FIDELITY`, a conv/linear unit's ∂W: 2 bits 0.90, 4 bits 0.996 (measured 0.79-0.91 and
  0.991-0.996);
- `NORM_FIDELITY`, a norm unit's own ∂γ/∂β: 2 bits 0.78, 4 bits 0.991 (0.76-0.84,
  0.988-0.991);
- `upstream_fidelity`, the units before a norm unit: 1 - UPSTREAM_LOSS[b] / n with n the
  values per statistic (B·H·W for BN). BN's ∂x reads its input only in the correction
  term x̂·mean(g·x̂), whose error shrinks as 1/n: measured 2-bit losses 3e-5-5e-4 at
  n = 784-12544 (ResNet-50 224 px) but 0.087 at n = 32 (ResNet-18 64 px, layer4); 4 bits
  lose ~27x less. UPSTREAM_LOSS[2] = 3 bounds the worst of these.
The tables were measured with groups of 128; the widths use GROUP = 256 entries per
min/scale pair: under a tight budget the min/scale pairs are a visible share of it, and
halving them buys more stored units than the coarser groups cost (bench_dynamic_widths.py).
One table for both parts (a norm unit's own fidelity applied to every unit before it) would
make every norm unit worth the whole network before it: the budget would go to BN inputs
at 8 bits and freeze most convs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tta_core.daf.arena import PagedArena
from tta_core.daf.arena_codec import ARENA_PAGE_BYTES, ArenaCodec, arena_stats
from tta_core.daf.bit_alloc import Allocation, UnitChoice, greedy_bits
from tta_core.memory import ActivationCodec, CodecPlan, SaveProfile, predicted_bytes
from tta_core.memory.ledger import MIB, SavedBytes, SaveEvent
from tta_core.memory.predict import profile_saves
from tta_core.memory.quant import MIN_QUANT_NUMEL, NORM_KINDS, Quant, quant_nbytes
from tta_core.memory.scope import OTHER, WGRAD, unit_table
from tta_core.runtime import losses

WGRAD_WIDTHS = (0, 2, 4, 8)
NORM_WIDTHS = (2, 4, 8)
FIDELITY = {0: 0.0, 2: 0.90, 4: 0.996, 8: 1.0}
NORM_FIDELITY = {2: 0.78, 4: 0.991, 8: 1.0}
UPSTREAM_LOSS = {2: 3.0, 4: 3.0 / 27, 8: 3.0 / (27 * 256)}  # x 1 / values per statistic
PROFILE_SAMPLES = 2  # BatchNorm1d needs > 1 value per channel
GROUP = 256  # entries per min/scale pair (module doc)


@dataclass
class WidthState:
    """The widths one batch ran with and what they were predicted to cost."""

    bits: dict[str, int] = field(default_factory=dict)
    budget_bytes: int = 0
    predicted_bytes: int = 0
    fits: bool = True  # the lowest widths fit the budget (else they are used anyway)
    frozen_units: int = 0
    arena_budget_bytes: int = 0  # with the arena: its capacity for this batch


def _profile(model: nn.Module, x: Tensor) -> SaveProfile:
    """profile_saves of a forward on x, the model's BN running statistics restored."""
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    try:
        return profile_saves(model, x.detach(), losses.entropy_loss)
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])


def batch_profile(model: nn.Module, x: Tensor) -> SaveProfile:
    """The saves of a forward on x's batch, profiled on its first PROFILE_SAMPLES samples
    and scaled up (module doc); the model's BN running statistics are left unchanged."""
    n = min(PROFILE_SAMPLES, int(x.shape[0]))
    prof = _profile(model, x[:n])
    scale = math.ceil(int(x.shape[0]) / n)
    events = [dataclasses.replace(e, numel=e.numel * scale,
                                  storage_nbytes=e.storage_nbytes * scale)
              for e in prof.events]
    return SaveProfile(events, prof.unit_names, tuple(x.shape), prof.unit_kinds)


def dense_bytes(model: nn.Module, x: Tensor) -> int:
    """Dense saved bytes of a forward on x's batch: exact for batches of <= 2 * PROFILE_
    SAMPLES, else the line through profiles of PROFILE_SAMPLES and 2 * PROFILE_SAMPLES
    samples (saves such as BN's per-channel statistics do not grow with the batch, so
    scaling one small profile overstates them)."""
    b = int(x.shape[0])
    dense = CodecPlan(act_masks=False)
    n1, n2 = min(PROFILE_SAMPLES, b), min(2 * PROFILE_SAMPLES, b)
    d2 = predicted_bytes(_profile(model, x[:n2]), dense).total
    if n2 == b:
        return d2
    d1 = predicted_bytes(_profile(model, x[:n1]), dense).total
    return round(d1 + (d2 - d1) * (b - n1) / (n2 - n1))


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


def upstream_fidelity(bits: int, count: float) -> float:
    """Share of the gradient energy of the units before a norm unit that its input at
    `bits` keeps, with `count` values per normalisation statistic (module doc)."""
    return max(0.0, 1.0 - UPSTREAM_LOSS[bits] / count)


def stat_counts(profile: SaveProfile, model: nn.Module, units: list[str]) -> dict[str, float]:
    """Values per normalisation statistic of each norm unit in `units`: its saved input's
    entries per channel (BN), its normalized shape's entries (LN) or per sample and group (GN)."""
    mods = dict(model.named_modules())
    out: dict[str, float] = {}
    for e in profile.events:
        kind = profile.unit_kinds.get(e.unit, "")
        if e.unit in units and e.unit not in out and kind in NORM_KINDS \
                and _varying(e, kind):
            out[e.unit] = _stat_count(mods[e.unit], kind, e)
    return out


def _stat_count(mod: nn.Module, kind: str, e: SaveEvent) -> float:
    """Values behind one statistic of norm module `mod` whose input save is `e`."""
    if kind == "bn":
        return e.numel / mod.num_features
    if kind == "gn":  # per sample and group: (C / G) * spatial entries
        shape = e.view[2]
        return float(math.prod(shape[1:])) / mod.num_groups
    return float(math.prod(mod.normalized_shape))


def unit_choices(order: list[str], kinds: Mapping[str, str], ma: Mapping[str, float],
                 mem: Mapping[str, Mapping[int, float]], counts: Mapping[str, float]
                 ) -> list[UnitChoice]:
    """The knapsack items in forward `order`: a unit's importance is its own average; a
    norm unit's also holds the averages of every unit before it, valued by its own table
    that mixes NORM_FIDELITY (its own gradient) and upstream_fidelity (theirs; `counts`:
    values per statistic, missing = unbounded)."""
    known = [v for v in ma.values() if v > 0]
    default = max(known) if known else 1.0
    out, before = [], 0.0
    for u in order:
        own = ma.get(u, default)
        if kinds[u] in NORM_KINDS and own + before > 0:
            n = counts.get(u, math.inf)
            fid = {b: (own * NORM_FIDELITY[b] + before * upstream_fidelity(b, n)) / (own + before)
                   for b in mem[u]}
            out.append(UnitChoice(u, own + before, mem[u], fidelity=fid))
        else:
            out.append(UnitChoice(u, own, mem[u]))
        before += own
    return out


def budget_bytes(options: object, dense_bytes: int) -> int:
    """The budget in bytes: `activation_budget_mb`, `activation_budget_frac` x dense_bytes
    (the batch's dense saved bytes), the smaller of both when both are set; ValueError
    naming a bad value."""
    mb = getattr(options, "activation_budget_mb", None)
    frac = getattr(options, "activation_budget_frac", None)
    out = []
    if mb is not None or frac is None:
        if isinstance(mb, bool) or not isinstance(mb, int | float) or not 0 < mb < 1e6:
            raise ValueError(f"activation_budget_mb must be a number in (0, 1e6) MiB, got "
                             f"{mb!r}")
        out.append(int(mb * MIB))
    if frac is not None:
        if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 < frac <= 1:
            raise ValueError(f"activation_budget_frac must be a number in (0, 1], got {frac!r}")
        out.append(int(frac * dense_bytes))
    return min(out)


def _plan(bits: Mapping[str, int]) -> CodecPlan:
    """The codec plan of these widths; other norm units' inputs at 8 bits, ReLU masks."""
    return CodecPlan(bits=dict(bits), norm_bits=8, group=GROUP, narrow_ints=True)


class DynamicWidths:
    """StepCodec of dynamic DAF widths under `options.activation_budget_mb` and/or
    `activation_budget_frac` (module doc)."""

    def __init__(self, model: nn.Module, options: object, ema: float = 0.9) -> None:
        self.model, self.options, self.ema = model, options, ema
        rows = unit_table(model)[1]
        self._kinds = {n: k for n, _m, k in rows}
        self._params = {n: list(m.parameters(recurse=False)) for n, m, _k in rows}
        self.ma: dict[str, float] = {}
        self._costs: dict[tuple, tuple] = {}  # (bytes per width, fixed, order, counts, prof)
        self._dense: dict[tuple, int] = {}  # dense saved bytes per key (fractions)
        self.state = WidthState()
        self.codec: ActivationCodec | None = None
        self.arena: PagedArena | None = None  # built at the first budget (its page size)
        self._use_arena = bool(getattr(options, "activation_arena", False))
        self._frozen: list[nn.Parameter] = []
        self._peak: SavedBytes | None = None  # the largest forward since before_forward

    def _widths(self) -> tuple[dict[str, tuple[int, ...]], dict[str, int], set[str]]:
        """(allowed widths of each unit with a trainable parameter and of each frozen norm
        unit, whose input the ∂x of the units before it needs; 0 bits for the frozen
        conv/linear units: backward never reads their input; the frozen norm units)."""
        out, frozen, frozen_norms = {}, {}, set()
        for n, ps in self._params.items():
            wgrad = self._kinds[n] in ("conv", "linear")
            trains = any(p.requires_grad for p in ps)
            if not trains and wgrad:
                frozen[n] = 0
            elif self._kinds[n] in NORM_KINDS:
                out[n] = NORM_WIDTHS
                if not trains:
                    frozen_norms.add(n)
            elif wgrad:
                out[n] = WGRAD_WIDTHS
        return out, frozen, frozen_norms

    def before_forward(self, x: Tensor) -> None:
        """Choose this batch's widths (greedy knapsack under the current budget); the units
        given 0 bits are frozen during every forward under this codec until the next call."""
        widths, frozen, frozen_norms = self._widths()
        key = (tuple(x.shape), tuple(widths))
        if key not in self._costs:
            prof = batch_profile(self.model, x)
            mem, fixed = unit_costs(prof, widths, frozen)
            order = [u for u in prof.unit_names if u in widths]
            self._costs[key] = (mem, fixed, order, stat_counts(prof, self.model, order), prof)
        mem, fixed, order, counts, prof = self._costs[key]
        if getattr(self.options, "activation_budget_frac", None) is not None \
                and key not in self._dense:
            self._dense[key] = dense_bytes(self.model, x)
        budget = budget_bytes(self.options, self._dense.get(key, 0))
        ma = {**self.ma, **dict.fromkeys(frozen_norms, 0.0)}  # valued by the units before
        choices = unit_choices(order, self._kinds, ma, mem, counts)
        if self._use_arena and self.arena is None:
            self.arena = PagedArena(0, page_size=arena_page_bytes(budget))
        # the arena rounds each entry up to whole pages: reserve a page per quantized save
        waste = 0 if self.arena is None else self.arena.page_size * quantized_saves(
            prof, _plan({**frozen, **{u: min(ws) for u, ws in widths.items()}}))[1]
        alloc, fits = self._allocate(choices, budget - fixed - waste)
        self.state = WidthState(alloc.bits, budget, int(fixed + alloc.mem), fits,
                                sum(1 for b in alloc.bits.values() if b == 0))
        self._frozen = [p for u, b in alloc.bits.items() if b == 0
                        for p in self._params[u] if p.requires_grad]
        plan = _plan({**frozen, **alloc.bits})
        self._peak = None
        if self.codec is not None:  # the same units: only the plan changes (a codec walks
            self.codec.plan = plan  # the model when built)
        elif self.arena is not None:
            self.codec = ArenaCodec(self.model, plan, self.arena)
        else:
            self.codec = ActivationCodec(self.model, plan)
        if self.arena is not None:  # the arena: the budget less what it does not hold
            for k in list(self.arena.table):  # last batch's, read by its backward already
                self.arena.remove(k)
            outside = self.state.predicted_bytes - quantized_saves(prof, plan)[0]
            self.arena.resize(max(0, budget - outside))
            self.codec.importance = dict(self.ma)  # type: ignore[attr-defined]
            self.state.arena_budget_bytes = self.arena.capacity
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
        for p in self._frozen:  # 0 bits: not stored, so no ∂W for this batch
            p.requires_grad_(False)
        try:
            self.codec.__enter__()
        except BaseException:
            self._thaw()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.codec is not None
        try:
            self.codec.__exit__(*exc)
        finally:  # the recorded graph keeps them frozen for this batch
            self._thaw()
        res = self.codec.result
        if res is not None and (self._peak is None or res.total > self._peak.total):
            self._peak = res

    def _thaw(self) -> None:
        for p in self._frozen:
            p.requires_grad_(True)

    @property
    def result(self) -> SavedBytes | None:
        """The saves of the largest forward run under the widths of this batch (a method
        with two recorded forwards, SAR, holds one graph at a time)."""
        return self._peak

    def after_backward(self, model: nn.Module) -> None:
        """MA_i update from this step's gradients (units that had one)."""
        units, grads = [], []
        for u, ps in self._params.items():
            gs = [p.grad.detach() for p in ps if p.grad is not None]
            if gs:
                units.append((u, len(gs)))
                grads += gs
        if not grads:
            return
        sq = torch.stack(torch._foreach_norm(grads)).double().square().tolist()  # one read
        i = 0
        for u, n in units:
            energy = sum(sq[i:i + n])
            i += n
            old = self.ma.get(u)
            self.ma[u] = energy if old is None else self.ema * old + (1 - self.ema) * energy

    def stats(self) -> dict[str, float | int | bool]:
        """Saved bytes measured, budget, whether it held, the widths' spread (and, with the
        arena, what it held: the whole preallocated arena counts against the budget)."""
        s = self.state
        saved = self._peak.total if self._peak is not None else 0
        widths = list(s.bits.values()) or [0]
        out: dict[str, float | int | bool] = {
            "saved_bytes": saved, "width_budget_bytes": s.budget_bytes,
            "width_predicted_bytes": s.predicted_bytes,
            "within_width_budget": saved <= s.budget_bytes and s.fits,
            "width_frozen_units": s.frozen_units,
            "width_mean_bits": sum(widths) / len(widths),
            **{f"width_units_{b}bit": widths.count(b) for b in WGRAD_WIDTHS}}
        if isinstance(self.codec, ArenaCodec):
            arena = arena_stats(self.codec)
            outside = saved - self.codec.arena_stored_bytes
            held = outside + arena["arena_budget_bytes"]
            out.update(arena, saved_bytes_with_arena=held,
                       within_width_budget=held <= s.budget_bytes and s.fits
                       and bool(arena["within_arena_budget"]))
        return out


def arena_page_bytes(budget: int) -> int:
    """The arena's page: ARENA_PAGE_BYTES, smaller (a power of two, >= 256) for budgets
    under 4096 pages of it, so that rounding entries up to pages stays a small share."""
    page = ARENA_PAGE_BYTES
    while page > 256 and budget < 4096 * page:
        page //= 2
    return page


def quantized_saves(profile: SaveProfile, plan: CodecPlan) -> tuple[int, int]:
    """(predicted bytes, count) of the saves `plan` quantizes (what an arena holds), each
    encoding once, as predicted_bytes counts them."""
    seen: set[tuple] = set()
    total = 0
    for e in profile.events:
        enc = plan.encoding(e.role, e.unit, e.elem, profile.unit_kinds.get(e.unit, ""),
                            e.numel, e.floating)
        if isinstance(enc, Quant) and enc.bits and (e.view, enc) not in seen:
            seen.add((e.view, enc))
            total += quant_nbytes(e.numel, enc.bits, enc.group)
    return total, len(seen)

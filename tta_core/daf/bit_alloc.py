"""DAF's greedy two-budget bit allocation (§3.4.1): per unit, a width in {0, 2, 4, 8}
maximising stored importance under a memory budget (bytes) and a time budget (ms).

Value of unit i at width b: importance_i * FIDELITY[b] (or the unit's own table,
`UnitChoice.fidelity`, when its widths act on the gradient differently). Importance:
gradient statistics, the RMS of the unit's last weight gradient (as SURGEON's Eq. 4:
runtime.stats.gradient_rms), lagged by one update (the allocation is decided before the
forward, so it cannot use this batch's gradient); AdaShadow's backprop-free KL was not
wired in. FIDELITY orders the widths as the measured gradient cosines do (2 bits: 0.96, 4: 0.998,
8: 1.000 on the shipped net) and charges 2 bits more than its cosine alone, since its error
compounds across layers; callers may pass their own table.

Greedy (the paper's reading): start every unit at its lowest allowed width (must be
feasible); repeatedly take the feasible upgrade (any higher width of one unit) with the best
value gain per unit of the *tighter* resource (the one with the smaller remaining fraction),
ties broken by the gain per unit of the other; stop when nothing fits. Like ratio-greedy
for knapsack it can miss by a lot when one large upgrade is worth more than the many small
ones it was blocked by, so the result is the better of the greedy and the best single
upgrade: with one budget and widths {0, 8} that is the classic 1/2-approximation of 0/1
knapsack (asserted by the tests against brute force); with two budgets and four widths
the tests measure the gap on random instances. It is always feasible.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

FIDELITY: Mapping[int, float] = {0: 0.0, 2: 0.6, 4: 0.95, 8: 1.0}


@dataclass(frozen=True)
class UnitChoice:
    """One unit's options: bytes and ms per allowed width (keys: the allowed widths)."""

    name: str
    importance: float
    mem: Mapping[int, float]
    time: Mapping[int, float] = field(default_factory=dict)  # missing widths: 0 ms
    fidelity: Mapping[int, float] | None = None  # this unit's own table (None: the caller's)

    def fid(self, table: Mapping[int, float]) -> Mapping[int, float]:
        """The fidelity table that values this unit: its own, else `table`."""
        return table if self.fidelity is None else self.fidelity

    def cost(self, bits: int) -> tuple[float, float]:
        """(bytes, ms) at `bits`."""
        return float(self.mem[bits]), float(self.time.get(bits, 0.0))


@dataclass
class Allocation:
    """Chosen widths, their total value, bytes and ms."""

    bits: dict[str, int]
    value: float
    mem: float
    time: float


def _evaluate(units: Sequence[UnitChoice], bits: Mapping[str, int],
              fidelity: Mapping[int, float]) -> Allocation:
    mem = sum(u.cost(bits[u.name])[0] for u in units)
    time = sum(u.cost(bits[u.name])[1] for u in units)
    value = sum(u.importance * u.fid(fidelity)[bits[u.name]] for u in units)
    return Allocation(dict(bits), value, mem, time)


def _check(units: Sequence[UnitChoice], fidelity: Mapping[int, float]) -> None:
    for u in units:
        bad = [b for b in u.mem if b not in u.fid(fidelity)]
        if not u.mem or bad:
            raise ValueError(f"unit {u.name!r}: widths {sorted(u.mem)} must be non-empty and "
                             f"in the fidelity table {sorted(u.fid(fidelity))}")
        if u.importance < 0:
            raise ValueError(f"unit {u.name!r}: importance must be >= 0, got {u.importance}")


def _upgrades(u: UnitChoice, cur: int, fidelity: Mapping[int, float]
              ) -> list[tuple[int, float, float, float]]:
    """(width, value gain, extra bytes, extra ms) of every higher width of u."""
    m0, t0 = u.cost(cur)
    fid = u.fid(fidelity)
    out = []
    for b in sorted(u.mem):
        if b > cur:
            m, t = u.cost(b)
            out.append((b, u.importance * (fid[b] - fid[cur]), m - m0, t - t0))
    return out


def _score(gain: float, dm: float, dt: float, mem_tight: bool) -> tuple[float, float]:
    per_m = gain / dm if dm > 0 else math.inf
    per_t = gain / dt if dt > 0 else math.inf
    return (per_m, per_t) if mem_tight else (per_t, per_m)


def greedy_bits(units: Sequence[UnitChoice], mem_budget: float,
                time_budget: float = math.inf,
                fidelity: Mapping[int, float] = FIDELITY) -> Allocation:
    """The greedy allocation (module doc); ValueError if even the lowest widths don't fit.
    Totals are kept up to date per upgrade and each unit's upgrades are tabled once (it
    runs before every forward: ~100 units, hundreds of upgrades); with a memory budget
    only, a heap picks the same upgrades (`_greedy_heap`) instead of a scan per upgrade."""
    _check(units, fidelity)
    bits = {u.name: min(u.mem) for u in units}
    alloc = _evaluate(units, bits, fidelity)
    if alloc.mem > mem_budget or alloc.time > time_budget:
        raise ValueError(f"lowest widths need {alloc.mem:.0f} B / {alloc.time:.3g} ms: over "
                         f"the budgets {mem_budget:.0f} B / {time_budget:.3g} ms")
    table = [{cur: _upgrades(u, cur, fidelity) for cur in u.mem} for u in units]
    if math.isinf(time_budget) and all(dm >= 0 for ups in table for cur in ups.values()
                                       for _b, _g, dm, _t in cur):
        bits = _greedy_heap(units, table, bits, alloc.mem, mem_budget)
        return max(_evaluate(units, bits, fidelity),
                   _best_single(units, mem_budget, time_budget, fidelity), key=lambda a: a.value)
    mem, time = alloc.mem, alloc.time
    while True:
        mem_left = (mem_budget - mem) / mem_budget if mem_budget > 0 else 0.0
        time_left = ((time_budget - time) / time_budget
                     if math.isfinite(time_budget) and time_budget > 0 else math.inf)
        mem_tight = mem_left <= time_left
        best = None
        for u, ups in zip(units, table, strict=True):
            for b, gain, dm, dt in ups[bits[u.name]]:
                if gain <= 0 or mem + dm > mem_budget or time + dt > time_budget:
                    continue
                key = _score(gain, dm, dt, mem_tight)
                if best is None or key > best[0]:
                    best = (key, u.name, b, dm, dt)
        if best is None:
            break
        bits[best[1]] = best[2]
        mem, time = mem + best[3], time + best[4]
    return max(_evaluate(units, bits, fidelity),
               _best_single(units, mem_budget, time_budget, fidelity), key=lambda a: a.value)


def _greedy_heap(units: Sequence[UnitChoice], table: list[dict], bits: dict[str, int],
                 mem: float, mem_budget: float) -> dict[str, int]:
    """The scan's greedy with only a memory budget and no upgrade that frees bytes, in
    O(upgrades log upgrades): every key is then fixed (memory is always the tighter
    resource) and an upgrade that does not fit never fits later (memory only grows), so
    a heap of (key, unit index, width) pops the scan's choice, ties included."""
    heap: list[tuple] = []

    def push(i: int) -> None:
        cur = bits[units[i].name]
        for b, gain, dm, dt in table[i][cur]:
            if gain > 0:
                per_m, per_t = _score(gain, dm, dt, True)
                heapq.heappush(heap, (-per_m, -per_t, i, b, cur, dm))

    for i in range(len(units)):
        push(i)
    while heap:
        _pm, _pt, i, b, cur, dm = heapq.heappop(heap)
        name = units[i].name
        if bits[name] != cur or mem + dm > mem_budget:
            continue  # stale (the unit moved on) or never fits again
        bits[name], mem = b, mem + dm
        push(i)
    return bits


def _best_single(units: Sequence[UnitChoice], mem_budget: float, time_budget: float,
                 fidelity: Mapping[int, float]) -> Allocation:
    """The best allocation that raises one unit above its lowest width (or none)."""
    base = {u.name: min(u.mem) for u in units}
    start = _evaluate(units, base, fidelity)
    best, choice = start.value, None
    for u in units:
        for b, gain, dm, dt in _upgrades(u, base[u.name], fidelity):
            if start.mem + dm <= mem_budget and start.time + dt <= time_budget \
                    and start.value + gain > best:
                best, choice = start.value + gain, (u.name, b)
    return start if choice is None else _evaluate(units, {**base, choice[0]: choice[1]},
                                                  fidelity)


def brute_force_bits(units: Sequence[UnitChoice], mem_budget: float,
                     time_budget: float = math.inf,
                     fidelity: Mapping[int, float] = FIDELITY) -> Allocation | None:
    """The optimum by enumeration (tests only: prod of widths combinations)."""
    _check(units, fidelity)
    best = None
    for combo in itertools.product(*(sorted(u.mem) for u in units)):
        a = _evaluate(units, {u.name: b for u, b in zip(units, combo, strict=True)}, fidelity)
        if a.mem <= mem_budget and a.time <= time_budget and (best is None
                                                               or a.value > best.value):
            best = a
    return best

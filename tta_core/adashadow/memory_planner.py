"""One planner for latency and memory: AdaShadow's DP with a saved-bytes budget.

Cost model (contract; `brute_force_with_memory` and the tests implement the same). Time is
planner.py's model unchanged (T(S) <= sigma*T; the keep ratio does not change it). Memory:
units 0..N-1, keep options k_0..k_{K-1} (ratios in (0, 1]) and, per unit,

    mx[l]     bytes held for unit l whenever its forward is recorded, updated or not: the
              dx-chain saves (BN inputs, 1-bit ReLU masks, pooling indices; the loss's saves
              sit in the last unit) and its conv/linear input as a frozen unit keeps it (the
              codec at a tiny keep ratio; eager PyTorch without a codec keeps it dense);
    mw[l, j]  bytes ADDED when l is updated with keep option j (its dW input at keep k_j
              instead of the frozen form; 0 for BN units, whose dW input is mx's BN input);
    e[g]      entry bytes when recording starts at unit g: saves of units >= g that units
              below g would otherwise have held first (a shared storage), 0 by default;
    fid[l, j] gradient fidelity of option j in [0, 1] (cosine to the exact gradient).

A plan is (S, j_l for l in S). With d = min(S) the graph is recorded from unit g(d) =
record_start[d] on (default g(d) = d: recording starts at the lowest updated unit; the
engine's stage-granular recording is record_start = stage_start), and

    M(S, j)  = e[g(d)] + sum_{l >= g(d)} mx[l] + sum_{l in S} mw[l, j_l]
    value    = sum_{l in S} a_l * fid[l, j_l]

maximised subject to T(S) <= sigma*T and M(S, j) <= B_m. The empty plan holds 0 bytes.
Fidelity as a value discount: the first-order loss decrease of a step along a compressed
gradient g' is lr * <g, g'> = lr * |g| |g'| cos, so an importance predicted for the exact
gradient is scaled by the measured cosine of the keep ratio (DEFAULT_FIDELITY: conv dW
cosine at keep 1/0.5/0.3/0.1 with exact ReLU masks and dense BN inputs, small net, batch
16). One option per unit (keep fixed beforehand,
e.g. by a SURGEON-style rule) makes the DP choose units only.

Solver. Time is discretised exactly as planner.solve (same steps, same rounding). Memory:
with F_d = e[g(d)] + sum_{l >= g(d)} mx[l] (exact, per d) the spare B_m - min_d F_d is cut
into n_m steps; each item cost mw[l, j] is rounded UP separately and a d's item capacity is
floor((B_m - F_d) / step): a plan that fits the discretised budgets fits the real ones.
The sweep over d of planner.py keeps one table over (time steps x memory steps); inserting
unit d+1 is a multiple-choice knapsack update (best of "not updated" and each option),
O(N * K * n_t * n_m) with one vectorised numpy update per (unit, option). Exact shortcuts:
options dominated in (memory steps, value) are dropped, items of value 0 are never inserted
(the table is monotone: they cannot be strictly better), and the sweep stops once the time
fixed part exceeds its budget (it only grows as d falls) or every d' <= d has F_d' > B_m.
Rounding loses < 1 memory step per updated unit. DEFAULT_N_M = 128: on a ResNet-50
profile (107 units) a binding memory budget at sigma = 1 solves in ~20-25 ms with 0.93-0.98
of a 1024-step solve's objective (~1-2 ms at sigma = 0.33, where time prunes the sweep);
benchmarks/memory/bench_memory_planner.py.
With B_m = inf the memory axis has one cell and each unit keeps its highest-fidelity
option: the plan is planner.solve's (same updates, same strict tie-breaking) when that
fidelity is 1. Ties: a non-empty plan only for a strictly positive objective.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from tta_core.adashadow import planner
from tta_core.adashadow.planner import PlanProblem
from tta_core.api import Plan

DEFAULT_KEEPS = (1.0, 0.5, 0.3, 0.1)
DEFAULT_FIDELITY = (1.0, 0.996, 0.971, 0.819)
DEFAULT_N_M = 128
_BRUTE_FORCE_MAX_ROWS = 2_000_000
_MAX_OPTIONS = 100  # choice table is int8


@dataclass
class MemoryCosts:
    """Per-unit saved bytes of the contract (module docstring) and the keep options."""

    x_bytes: np.ndarray         # mx, (N,)
    w_bytes: np.ndarray         # mw, (N, K): added when the unit is updated at option j
    keeps: np.ndarray           # (K,) keep ratio of each option
    fidelity: np.ndarray        # (K,) or (N, K), in [0, 1]
    record_start: np.ndarray | None = None  # g(d) per d; None: g(d) = d
    entry_bytes: np.ndarray | None = None   # e[g] per first recorded unit; None: zeros


@dataclass
class MemoryPlan:
    """The chosen units, keep options and predicted cost on both budgets."""

    update: np.ndarray          # bool, per unit
    option: np.ndarray          # int per unit: keep option index, -1 when not updated
    keep: np.ndarray            # float per unit: keep ratio, NaN when not updated
    first_updated: int          # N when nothing is updated
    record_from: int            # g(first_updated): first unit whose forward is recorded
    objective: float            # sum of importance * fidelity over the update
    predicted_total_ms: float   # exact T_f + T_b'(S) + T_re'(S)
    predicted_bytes: float      # exact M(S, j)
    budget_ms: float
    budget_bytes: float
    full_ms: float
    solve_ms: float

    def as_plan(self) -> Plan:
        """The latency planner's Plan of the same update (what the engine consumes)."""
        return Plan(self.update, self.first_updated, self.objective, self.predicted_total_ms,
                    self.budget_ms, self.full_ms, self.solve_ms)


@dataclass
class _Memory:
    """Validated memory arrays (float64), the record start and fixed part per d."""

    extra: np.ndarray    # mw, (N, K)
    fid: np.ndarray      # (N, K)
    keeps: np.ndarray    # (K,)
    g: np.ndarray        # (N,) int
    fixed: np.ndarray    # F_d per d: e[g(d)] + sum_{l >= g(d)} mx[l]


@dataclass
class _Grid:
    """Discretised memory: item steps, capacity per d (-1: d does not fit), option values."""

    n_m: int
    item: np.ndarray     # (N, K) int steps of mw
    cap: np.ndarray      # (N,) int: floor((B_m - F_d) / step), -1 when F_d > B_m
    value: np.ndarray    # (N, K) a_l * fid[l, j]
    valid: np.ndarray    # (N, K) bool: option not dominated


def _matrix(name: str, value: object, shape: tuple[int, int]) -> np.ndarray:
    """A finite, non-negative float64 array of exactly `shape` (else a one-line error)."""
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0, got {arr.ravel()[:8]}")
    return arr


def _check_options(costs: MemoryCosts, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keeps, mw, fid) validated; fid broadcast to (N, K)."""
    keeps = planner._as_vector("keeps", costs.keeps, None)
    k = keeps.shape[0]
    if not 0 < k <= _MAX_OPTIONS or np.any(keeps <= 0) or np.any(keeps > 1):
        raise ValueError(f"keeps must be 1..{_MAX_OPTIONS} ratios in (0, 1], got {keeps}")
    mw = _matrix("w_bytes", costs.w_bytes, (n, k))
    fid = np.asarray(costs.fidelity, dtype=np.float64)
    if fid.shape == (k,):
        fid = np.broadcast_to(fid, (n, k))
    fid = _matrix("fidelity", fid, (n, k))
    if np.any(fid > 1):
        raise ValueError(f"fidelity must be in [0, 1], got max {fid.max()}")
    return keeps, mw, fid


def _validate_memory(costs: MemoryCosts, n: int) -> _Memory:
    """Checked arrays and the exact fixed part F_d (shared by solve, brute force, bytes)."""
    mx = planner._as_vector("x_bytes", costs.x_bytes, n)
    keeps, mw, fid = _check_options(costs, n)
    entry = (np.zeros(n) if costs.entry_bytes is None
             else planner._as_vector("entry_bytes", costs.entry_bytes, n))
    g = (np.arange(n) if costs.record_start is None
         else planner._validate_stage_start(costs.record_start, n))
    suffix = np.cumsum(mx[::-1])[::-1]
    return _Memory(mw, fid, keeps, g, entry[g] + suffix[g])


def _check_budget(budget_bytes: float, n_m: int) -> float:
    """The memory budget as a float (inf allowed) after checking it and n_m."""
    if isinstance(n_m, bool) or not isinstance(n_m, (int, np.integer)) or n_m < 1:
        raise ValueError(f"n_m must be a positive integer, got {n_m!r}")
    b = float(budget_bytes)
    if math.isnan(b) or b < 0:
        raise ValueError(f"memory budget must be >= 0 bytes (inf: none), got {budget_bytes}")
    return b


def _dominated(item: np.ndarray, value: np.ndarray) -> np.ndarray:
    """(N, K) bool: another option of the unit is no worse on both and better or earlier."""
    k = item.shape[1]
    ci, cj = item[:, :, None], item[:, None, :]    # [l, j, j']: option j vs option j'
    vi, vj = value[:, :, None], value[:, None, :]
    earlier = np.arange(k)[None, :] < np.arange(k)[:, None]  # [j, j']: j' before j
    no_worse = (cj <= ci) & (vj >= vi)
    strictly = (cj < ci) | (vj > vi) | earlier[None]
    return (no_worse & strictly).any(axis=2)


def _grid(mem: _Memory, importance: np.ndarray, budget: float, n_m: int) -> _Grid | None:
    """Discretised memory (module docstring); None when no d fits the memory budget."""
    n, k = mem.extra.shape
    value = importance[:, None] * mem.fid
    if math.isinf(budget):
        item = np.zeros((n, k), dtype=np.int64)
        cap = np.zeros(n, dtype=np.int64)
        n_m = 0
    else:
        spare = budget - float(mem.fixed.min())
        if spare <= 0:
            return None
        step = spare / n_m
        item = np.ceil(mem.extra / step).astype(np.int64)
        room = np.floor((budget - mem.fixed) / step)
        cap = np.where(room >= 0, np.minimum(room, n_m), -1).astype(np.int64)
    return _Grid(int(n_m), item, cap, value, ~_dominated(item, value))


def plan_bytes(costs: MemoryCosts, update: np.ndarray, option: np.ndarray) -> float:
    """Exact M(S, j) of a plan (bytes): 0 when S is empty."""
    sel, opt = np.asarray(update, dtype=bool), np.asarray(option)
    if sel.ndim != 1 or opt.shape != sel.shape:
        raise ValueError(f"update {sel.shape} and option {opt.shape} must be equal 1-D shapes")
    mem = _validate_memory(costs, sel.shape[0])
    if not sel.any():
        return 0.0
    if np.any(opt[sel] < 0) or np.any(opt[sel] >= mem.keeps.shape[0]):
        raise ValueError(f"option of an updated unit outside [0, {mem.keeps.shape[0]}): "
                         f"{opt[sel]}")
    d = int(np.argmax(sel))
    idx = np.flatnonzero(sel)
    return float(mem.fixed[d] + mem.extra[idx, opt[idx]].sum())


def _insert(table: np.ndarray, choice: np.ndarray, ct: int, grid: _Grid, u: int,
            work: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
    """Multiple-choice knapsack update of `table` with unit u (time steps ct); `work`:
    scratch arrays of the table's shape (old table, candidate, comparison)."""
    n_t, n_m = table.shape[0] - 1, table.shape[1] - 1
    opts = [j for j in np.flatnonzero(grid.valid[u])
            if grid.value[u, j] > 0 and grid.item[u, j] <= n_m]
    if ct > n_t or not opts:
        return
    old, cand_buf, better_buf = work
    if len(opts) > 1:
        np.copyto(old, table)
    else:  # one option: planner's 0/1 update (the candidate is built before the max)
        old = table
    for j in opts:
        cm = int(grid.item[u, j])
        rows, cols = n_t + 1 - ct, n_m + 1 - cm
        cand = np.add(old[:rows, :cols], grid.value[u, j], out=cand_buf[:rows, :cols])
        region = table[ct:, cm:]
        better = np.greater(cand, region, out=better_buf[:rows, :cols])
        np.copyto(choice[ct:, cm:], j + 1, where=better)
        np.maximum(region, cand, out=region)


def _best_option(table: np.ndarray, grid: _Grid, d: int, cap_t: int
                 ) -> tuple[float, int, int]:
    """(value, option, memory capacity left) of the best option of unit d as min(S)."""
    best = (-math.inf, -1, 0)
    for j in np.flatnonzero(grid.valid[d]):
        cm = int(grid.cap[d] - grid.item[d, j])
        if cm >= 0:
            val = grid.value[d, j] + table[cap_t, cm]
            if val > best[0]:
                best = (float(val), int(j), cm)
    return best


def _sweep(prep: planner._Prepared, grid: _Grid) -> tuple[tuple[int, int, int, int], np.ndarray]:
    """Sweep over d; returns ((d or -1, option, time cap, memory cap), choice table)."""
    n, n_t = prep.n, prep.n_t
    table = np.zeros((n_t + 1, grid.n_m + 1))
    choice = np.zeros((n, n_t + 1, grid.n_m + 1), dtype=np.int8)
    work = (np.empty_like(table), np.empty_like(table), np.empty(table.shape, dtype=bool))
    no_room_below = np.maximum.accumulate(grid.cap) < 0  # every d' <= d lacks memory
    best, best_val = (-1, -1, 0, 0), 0.0
    for d in range(n - 1, -1, -1):
        if d + 1 < n:  # table now covers items d+1 .. n-1
            _insert(table, choice[d + 1], int(prep.item[d + 1]), grid, d + 1, work)
        if prep.fixed[d] > n_t or no_room_below[d]:  # pruning rule 2, on both budgets
            break
        if grid.cap[d] < 0:
            continue
        cap_t = n_t - int(prep.fixed[d]) - int(prep.item[d])
        if cap_t < 0:
            continue
        val, j, cap_m = _best_option(table, grid, d, cap_t)
        if val > best_val:
            best, best_val = (d, j, cap_t, cap_m), val
    return best, choice


def _finish(costs: MemoryCosts, prep: planner._Prepared, mem: _Memory, option: np.ndarray,
            budget: float, t0: float) -> MemoryPlan:
    """MemoryPlan of the chosen options with exact (undiscretised) time and bytes."""
    update = option >= 0
    first = int(np.argmax(update)) if update.any() else prep.n
    idx = np.flatnonzero(update)
    value = float((prep.importance[idx] * mem.fid[idx, option[idx]]).sum())
    keep = np.where(update, mem.keeps[np.maximum(option, 0)], np.nan)
    base = planner._finish(prep, update, t0)
    return MemoryPlan(update, option, keep, first, int(mem.g[first]) if update.any() else prep.n,
                      value, base.predicted_total_ms, plan_bytes(costs, update, option),
                      base.budget_ms, budget, base.full_ms,
                      (time.perf_counter() - t0) * 1e3)


def _setup(problem: PlanProblem, costs: MemoryCosts, budget_bytes: float, n_t: int,
           n_m: int) -> tuple[planner._Prepared, _Memory, float, _Grid | None]:
    """Validated, discretised inputs (planner's time grid + the memory grid; None: only
    the empty plan fits)."""
    budget = _check_budget(budget_bytes, n_m)
    prep = planner._prepare(problem, n_t)
    mem = _validate_memory(costs, prep.n)
    grid = _grid(mem, prep.importance, budget, n_m) if prep.fits else None
    return prep, mem, budget, grid


def solve_with_memory(problem: PlanProblem, costs: MemoryCosts, budget_bytes: float,
                      n_t: int = planner.DEFAULT_N_T, n_m: int = DEFAULT_N_M) -> MemoryPlan:
    """Optimal plan for the discretised problem on both budgets (module docstring).

    budget_bytes: saved-activation bytes allowed (math.inf: latency only)."""
    t0 = time.perf_counter()
    prep, mem, budget, grid = _setup(problem, costs, budget_bytes, n_t, n_m)
    option = np.full(prep.n, -1, dtype=np.int64)
    if grid is not None and prep.importance.any():
        (d, j, cap_t, cap_m), choice = _sweep(prep, grid)
        if d >= 0:
            option[d] = j
            for u in range(d + 1, prep.n):  # reverse order of insertion
                c = int(choice[u, cap_t, cap_m])
                if c:
                    option[u] = c - 1
                    cap_t -= int(prep.item[u])
                    cap_m -= int(grid.item[u, c - 1])
    return _finish(costs, prep, mem, option, budget, t0)


def brute_force_with_memory(problem: PlanProblem, costs: MemoryCosts, budget_bytes: float,
                            n_t: int = planner.DEFAULT_N_T,
                            n_m: int = DEFAULT_N_M) -> MemoryPlan:
    """Exhaustive search over every (S, keep option per unit) with solve's discretised
    costs, without its dominance and zero-value shortcuts: (K+1)^N assignments."""
    t0 = time.perf_counter()
    prep, mem, budget, grid = _setup(problem, costs, budget_bytes, n_t, n_m)
    n, k = mem.extra.shape
    if (k + 1) ** n > _BRUTE_FORCE_MAX_ROWS:
        raise ValueError(f"brute force over (K+1)^N = {k + 1}^{n} assignments is too large")
    option = np.full(n, -1, dtype=np.int64)
    if grid is not None:
        codes = np.arange(1, (k + 1) ** n, dtype=np.int64)
        digits = (codes[:, None] // (k + 1) ** np.arange(n)) % (k + 1) - 1  # -1: not in S
        sel = digits >= 0
        d = np.argmax(sel, axis=1)
        j = np.maximum(digits, 0)
        rows = np.arange(n)[None, :]
        t_cost = sel.astype(np.int64) @ prep.item + prep.fixed[d]
        m_cost = np.where(sel, grid.item[rows, j], 0).sum(axis=1)
        value = np.where(sel, grid.value[rows, j], 0.0).sum(axis=1)
        ok = (t_cost <= prep.n_t) & (grid.cap[d] >= 0) & (m_cost <= grid.cap[d])
        value = np.where(ok, value, -np.inf)
        best = int(np.argmax(value))
        if value[best] > 0:
            option = digits[best].copy()
    return _finish(costs, prep, mem, option, budget, t0)

"""Layer-update scheduler of AdaShadow §3.3: choose which units to update within a budget.

Cost model (DESIGN §3, contract). Units 0..N-1 in forward order with per-unit times
w_l (weight gradient), x_l (input gradient through unit l) and r_l (reforward). For a plan S
with d = min(S):

    T_b'(S)  = sum_{l in S} w_l + sum_{l = d+1 .. N-1} x_l
    T_re'(S) = sum_{l >= stage_start[d]} r_l
    T        = T_f + sum w + sum_{l >= 1} x_l + sum r          (full update)

and the problem is  max sum_{l in S} a_l  s.t.  T_f + T_b'(S) + T_re'(S) <= sigma * T.
The empty plan costs T_f alone. An absolute budget (`budget_ms`, a deadline:
tta_core.runtime.deadline) replaces sigma * T when given; sigma is then not used.

Fixed cost (extension of the contract, 0 by default): `overhead_ms` is time that every
non-empty plan pays whatever its units (launching the backward, the loss head's gradient,
the optimizer step, the reforward's call overhead), so it is added to T_b'(S) for S != {}
and to T (a full update pays it too). Per-unit times scale with MACs; this part does not,
and on a small net it is most of a sparse update (on the 32 px net at small batches,
per-unit times alone predict a small fraction of the measured backward).

Solver. The spare budget B = sigma*T - T_f is cut into n_t steps; every cost is rounded UP
to whole steps, separately per item, so a plan that fits the discretised budget also fits
the real one. For a fixed d the cost splits into a fixed part F_d = w_d + sum_{l>d} x_l +
reforward(d) and a 0/1 knapsack over {w_l : l > d}. Sweeping d from N-1 down to 0 and
adding unit d+1 to a single knapsack table before evaluating d gives O(N * n_t) work with
one vectorised numpy update per unit, instead of the paper's O(N^2 * n_t). Pruning rules
of the paper: the table never holds budgets beyond B (rule 1), and once the fixed
backward+reforward part alone exceeds B the sweep stops, since it only grows as d moves
towards the input (rule 2).

Ties: a non-empty plan is chosen only when its objective is strictly positive, so all-zero
importance gives the empty plan (updating would cost time for no predicted gain).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tta_core.api import Plan

DEFAULT_N_T = 500
_BRUTE_FORCE_MAX_UNITS = 20


@dataclass
class PlanProblem:
    """Inputs of one planning call; times in ms, arrays indexed by unit."""

    w: np.ndarray
    x: np.ndarray
    r: np.ndarray
    stage_start: np.ndarray
    importance: np.ndarray
    forward_ms: float
    sigma: float
    overhead_ms: float = 0.0  # fixed cost of any non-empty plan (module docstring)
    budget_ms: float | None = None  # absolute budget (a deadline); None: sigma * T


@dataclass
class _Prepared:
    """Validated float arrays plus the discretised costs shared by solve and brute_force."""

    n: int
    importance: np.ndarray
    full_ms: float
    budget_ms: float
    item: np.ndarray        # int steps of w_l
    fixed: np.ndarray       # int steps of sum_{l>d} x_l + reforward(d), per d
    n_t: int
    fits: bool              # False when the spare budget is <= 0 (only the empty plan)
    forward_ms: float       # T_f
    w: np.ndarray           # exact ms of the items
    fixed_ms: np.ndarray    # exact ms of the fixed part, per d


def _as_vector(name: str, value: object, n: int | None) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} has length {arr.shape[0]}, expected {n}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or inf: {arr}")
    if np.any(arr < 0):
        raise ValueError(f"{name} must be >= 0, got min {arr.min()}")
    return arr


def _validate_stage_start(stage_start: object, n: int) -> np.ndarray:
    raw = np.asarray(stage_start)
    if raw.ndim != 1 or raw.shape[0] != n:
        raise ValueError(f"stage_start must have shape ({n},), got {raw.shape}")
    if raw.dtype.kind not in "iu":
        raise ValueError(f"stage_start must be integers, got dtype {raw.dtype}")
    ss = raw.astype(np.int64)
    idx = np.arange(n)
    if np.any(ss < 0) or np.any(ss > idx):
        raise ValueError(f"stage_start[l] must be in [0, l], got {ss}")
    if np.any(np.diff(ss) < 0):
        raise ValueError(f"stage_start must be non-decreasing, got {ss}")
    return ss


def _validate(problem: PlanProblem) -> tuple[np.ndarray, ...]:
    w = _as_vector("w", problem.w, None)
    n = w.shape[0]
    if n == 0:
        raise ValueError("the problem has no units (len(w) == 0)")
    x = _as_vector("x", problem.x, n)
    r = _as_vector("r", problem.r, n)
    a = _as_vector("importance", problem.importance, n)
    ss = _validate_stage_start(problem.stage_start, n)
    tf = float(problem.forward_ms)
    if not np.isfinite(tf) or tf < 0:
        raise ValueError(f"forward_ms must be finite and >= 0, got {problem.forward_ms}")
    sigma = float(problem.sigma)
    if problem.budget_ms is not None:
        if not (np.isfinite(problem.budget_ms) and problem.budget_ms >= 0):
            raise ValueError(f"budget_ms must be finite and >= 0, got {problem.budget_ms}")
    elif not (0.0 < sigma <= 1.0):
        raise ValueError(f"sigma must be in (0, 1], got {problem.sigma}")
    oh = float(problem.overhead_ms)
    if not np.isfinite(oh) or oh < 0:
        raise ValueError(f"overhead_ms must be finite and >= 0, got {problem.overhead_ms}")
    return w, x, r, ss, a, tf, sigma, oh


def _fixed_cost_ms(x: np.ndarray, r: np.ndarray, ss: np.ndarray, oh: float) -> np.ndarray:
    """Per d: overhead + sum_{l>d} x_l + sum_{l >= stage_start[d]} r_l (exact ms)."""
    x_after = np.concatenate([np.cumsum(x[::-1])[::-1][1:], [0.0]])
    r_from = np.cumsum(r[::-1])[::-1]
    return oh + x_after + r_from[ss]


def full_ms(w: np.ndarray, x: np.ndarray, r: np.ndarray, tf: float, oh: float) -> float:
    """T: forward, every unit's weight gradient, the whole dx chain, full reforward."""
    return float(tf + oh + w.sum() + x[1:].sum() + r.sum())


def _budget(problem: PlanProblem, sigma: float, full: float) -> float:
    """The problem's absolute budget if it has one, else sigma * T."""
    return float(problem.budget_ms) if problem.budget_ms is not None else sigma * full


def _prepare(problem: PlanProblem, n_t: int) -> _Prepared:
    if isinstance(n_t, bool) or not isinstance(n_t, (int, np.integer)) or n_t < 1:
        raise ValueError(f"n_t must be a positive integer, got {n_t!r}")
    w, x, r, ss, a, tf, sigma, oh = _validate(problem)
    n = w.shape[0]
    full = full_ms(w, x, r, tf, oh)
    budget = _budget(problem, sigma, full)
    spare = budget - tf
    fixed_ms = _fixed_cost_ms(x, r, ss, oh)
    if spare <= 0:
        zeros = np.zeros(n, dtype=np.int64)
        return _Prepared(n, a, full, budget, zeros, zeros, int(n_t), False, tf, w, fixed_ms)
    step = spare / n_t
    item = np.ceil(w / step).astype(np.int64)
    fixed = np.ceil(fixed_ms / step).astype(np.int64)
    return _Prepared(n, a, full, budget, item, fixed, int(n_t), True, tf, w, fixed_ms)


def backward_cost(w: np.ndarray, x: np.ndarray, update: np.ndarray) -> float:
    """sum_{l in S} w_l + sum_{l > d} x_l with d = min(S); 0 for an empty plan (T_b'(S)
    without the fixed overhead)."""
    sel = np.asarray(update, dtype=bool)
    if sel.shape != np.shape(w) or sel.shape != np.shape(x):
        raise ValueError(f"update shape {sel.shape} does not match w {np.shape(w)}, "
                         f"x {np.shape(x)}")
    if not sel.any():
        return 0.0
    d = int(np.argmax(sel))
    return float(np.asarray(w)[sel].sum() + np.asarray(x)[d + 1:].sum())


def plan_cost(problem: PlanProblem, update: np.ndarray) -> float:
    """Exact predicted total time T_f + T_b'(S) + T_re'(S) of a plan (ms)."""
    w, x, r, ss, _, tf, _, oh = _validate(problem)
    sel = np.asarray(update, dtype=bool)
    if not sel.any():
        backward_cost(w, x, sel)  # shape check
        return tf
    return float(tf + oh + backward_cost(w, x, sel) + r[ss[int(np.argmax(sel))]:].sum())


def lowest_feasible_unit(problem: PlanProblem, candidates: np.ndarray | None = None,
                         *, validated: bool = False) -> int:
    """Smallest d such that the one-unit plan {d} fits the budget (N when none does),
    among `candidates` (bool per unit; every unit when None).

    Every plan S has cost >= cost({min S}), so no feasible plan reaches below this unit:
    the engine need not record the autograd graph under it. Uses the exact costs, which are
    never above the discretised ones `solve` compares, so it is never above solve's d.
    `validated`: the problem was just checked (by `solve`), skip the checks (hot path).
    """
    if validated:
        w, x, r, ss = (np.asarray(v) for v in (problem.w, problem.x, problem.r,
                                                problem.stage_start))
        tf, sigma, oh = problem.forward_ms, problem.sigma, problem.overhead_ms
    else:
        w, x, r, ss, _, tf, sigma, oh = _validate(problem)
    budget = _budget(problem, sigma, full_ms(w, x, r, tf, oh))
    ok = tf + w + _fixed_cost_ms(x, r, ss, oh) <= budget
    if candidates is not None:
        ok &= np.asarray(candidates, dtype=bool)
    fits = np.flatnonzero(ok)
    return int(fits[0]) if fits.size else int(w.shape[0])


def cheapest_unit_ms(problem: PlanProblem, candidates: np.ndarray | None = None) -> float:
    """Cost of the cheapest one-unit plan among `candidates` (exact ms: T_f, its ∂w, the
    dx chain above it, its reforward, the fixed cost); inf when there is no candidate.
    Divided by T it is the least sigma at which some unit fits."""
    w, x, r, ss, _, tf, _sigma, oh = _validate(problem)
    cost = tf + w + _fixed_cost_ms(x, r, ss, oh)
    if candidates is not None:
        cost = np.where(np.asarray(candidates, dtype=bool), cost, np.inf)
    return float(cost.min())


def _finish(prep: _Prepared, update: np.ndarray, t0: float) -> Plan:
    first = int(np.argmax(update)) if update.any() else prep.n
    # plan_cost without validating the problem again (the planner's hot path)
    cost = prep.forward_ms + (prep.w[update].sum() + prep.fixed_ms[first] if first < prep.n
                              else 0.0)
    return Plan(
        update=update,
        first_updated=first,
        objective=float(prep.importance[update].sum()),
        predicted_total_ms=float(cost),
        budget_ms=float(prep.budget_ms),
        full_ms=float(prep.full_ms),
        solve_ms=(time.perf_counter() - t0) * 1e3,
    )


def _sweep(prep: _Prepared) -> tuple[int, int, float, np.ndarray]:
    """Knapsack sweep over d; returns (best d or -1, its spare steps, value, choice bits)."""
    n, n_t, a, item = prep.n, prep.n_t, prep.importance, prep.item
    table = np.zeros(n_t + 1)
    keep = np.zeros((n, n_t + 1), dtype=bool)
    best_d, best_cap, best_val = -1, 0, 0.0
    for d in range(n - 1, -1, -1):
        if d + 1 < n:  # table now covers items d+1 .. n-1
            c = int(item[d + 1])
            if c <= n_t:
                cand = table[: n_t + 1 - c] + a[d + 1]
                better = cand > table[c:]
                keep[d + 1, c:] = better
                np.maximum(table[c:], cand, out=table[c:])
        if prep.fixed[d] > n_t:  # pruning rule 2: only grows for smaller d
            break
        cap = n_t - int(prep.fixed[d]) - int(item[d])
        if cap < 0:
            continue
        val = a[d] + table[cap]
        if val > best_val:
            best_d, best_cap, best_val = d, cap, val
    return best_d, best_cap, best_val, keep


def solve(problem: PlanProblem, n_t: int = DEFAULT_N_T) -> Plan:
    """Optimal plan for the discretised problem in O(N * n_t) (see module docstring)."""
    t0 = time.perf_counter()
    prep = _prepare(problem, n_t)
    update = np.zeros(prep.n, dtype=bool)
    if prep.fits and prep.importance.any():  # all-zero importance: the empty plan (ties)
        d, cap, _, keep = _sweep(prep)
        if d >= 0:
            update[d] = True
            for u in range(d + 1, prep.n):  # reverse order of insertion
                if keep[u, cap]:
                    update[u] = True
                    cap -= int(prep.item[u])
    return _finish(prep, update, t0)


def brute_force(problem: PlanProblem, n_t: int = DEFAULT_N_T) -> Plan:
    """Exhaustive search over all 2^N plans with the same discretised costs as `solve`."""
    t0 = time.perf_counter()
    prep = _prepare(problem, n_t)
    n = prep.n
    if n > _BRUTE_FORCE_MAX_UNITS:
        raise ValueError(f"brute_force supports at most {_BRUTE_FORCE_MAX_UNITS} units, got {n}")
    update = np.zeros(n, dtype=bool)
    if prep.fits:
        codes = np.arange(1, 2**n, dtype=np.int64)
        masks = ((codes[:, None] >> np.arange(n)) & 1).astype(bool)
        d = np.argmax(masks, axis=1)
        cost = masks.astype(np.int64) @ prep.item + prep.fixed[d]
        value = np.where(cost <= prep.n_t, masks @ prep.importance, -np.inf)
        best = int(np.argmax(value))
        if value[best] > 0:
            update = masks[best].copy()
    return _finish(prep, update, t0)

"""Offline per-unit latency profile (AdaShadow §3.2: t_l^off for ∂w, ∂x and reforward).

Reforward r_l: forward hooks timestamp the end of every unit of a forward under no_grad
(what the reforward is); r_l is the time from the previous unit's end to this unit's end,
so non-parameterised layers (ReLU, pooling, adds) are charged to the unit that follows
them and sum(r) ≈ the forward time. g_l: the same for a forward that records the autograd
graph (the forward feedback's reference above the engine's floor).
Backward b_l: tensor hooks timestamp the arrival of the gradient at every unit's input
during one full backward; sorted by arrival, b_l is the gap since the previous arrival.
The split of b_l into ∂w and ∂x: split="macs" (default) divides b_l by the unit's MAC
ratio, as the paper does. split="plans" instead fits w and x to what the planner's cost
model is about: the measured sparse backward T_b'(S) of 2N plans, every suffix {d..N-1}
and every single unit {d}, each timed after its own forward, by non-negative least
squares; the linear model of DESIGN §3 is identified exactly by these plans. A unit's
kernels do not cost inside a full backward what they cost in a sparse one (the same conv
backward node runs slower inside the full one), so timings cut out of one full backward
misjudge sparse plans: "plans" cuts the error on random sparse plans (ResNet-50 and the
small net; `tta predictor-bench` measures it), at 2N extra forwards and backwards per
repeat (a ResNet-50 profile at batch 4 on one CPU thread takes minutes). Median over
`repeats` runs after one warm-up. A single sparse-backward timing is noisy on a shared
machine, and the fit is exactly determined, so a plan's predicted time inherits that
noise; more repeats narrow the spread of a fixed plan's prediction from profile to
profile (the default 5 against 3, each repeat adding to the profile's time).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from tta_core.adashadow.predictor import UnitProfile
from tta_core.model.units import StagedModel


def device_name(device: torch.device) -> str:
    """"cpu" or the CUDA device name (profiles are keyed by it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def _clock(cuda: bool) -> Callable[[], float]:
    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()
    return now


def _groups(staged: StagedModel) -> list[list[int]]:
    """Units grouped by module (attention in/out projections share one module)."""
    groups: dict[int, list[int]] = {}
    for u in staged.units:
        groups.setdefault(id(u.module), []).append(u.index)
    return list(groups.values())


def _split(total: np.ndarray, idx: list[int], weights: np.ndarray, out: np.ndarray) -> None:
    share = weights[idx] / max(weights[idx].sum(), 1e-30)
    out[idx] += total * share


def _unit_forward_ms(staged: StagedModel, groups: list[list[int]], fwd_end: np.ndarray,
                     t0: float, t1: float) -> np.ndarray:
    """Per-unit forward times from the end timestamps of every unit group."""
    fwd_macs = np.array([u.macs_fwd for u in staged.units], dtype=np.float64)
    r = np.zeros(len(staged.units))
    order = np.argsort(fwd_end)
    prev = t0
    for g in order:
        _split(np.float64(fwd_end[g] - prev), groups[g], fwd_macs, r)
        prev = fwd_end[g]
    _split(np.float64(t1 - prev), groups[order[-1]], fwd_macs, r)  # tail after last unit
    return r * 1e3


def _nograd_run(staged: StagedModel, x: Tensor, now: Callable[[], float]) -> np.ndarray:
    """Per-unit ms of one forward under no_grad: what the reforward costs."""
    groups = _groups(staged)
    fwd_end = np.zeros(len(groups))
    handles = [staged.units[idx[0]].module.register_forward_hook(
        lambda _m, _a, _o, g=g: fwd_end.__setitem__(g, now())) for g, idx in enumerate(groups)]
    try:
        with torch.no_grad():
            t0 = now()
            staged.model(x)
            t1 = now()
    finally:
        for h in handles:
            h.remove()
    return _unit_forward_ms(staged, groups, fwd_end, t0, t1)


def _one_run(staged: StagedModel, x: Tensor, now: Callable[[], float]) -> tuple:
    """(g_ms, b_ms, forward_ms) of one forward that records the graph + full backward."""
    n = len(staged.units)
    groups = _groups(staged)
    fwd_end = np.zeros(len(groups))
    bwd_at = np.full(len(groups), np.nan)
    handles = []

    def fhook(g: int):
        def hook(_m, args, _out):
            fwd_end[g] = now()
            inp = args[0]
            if isinstance(inp, Tensor) and inp.requires_grad:
                inp.register_hook(lambda _grad: bwd_at.__setitem__(g, now()))
        return hook

    for g, idx in enumerate(groups):
        handles.append(staged.units[idx[0]].module.register_forward_hook(fhook(g)))
    try:
        x = x.detach().requires_grad_(True)  # so the first unit's input gets a gradient
        t0 = now()
        logits = staged.model(x)
        t1 = now()
        loss = logits.float().logsumexp(1).mean()
        tb = now()
        loss.backward()
        t2 = now()
    finally:
        for h in handles:
            h.remove()
    bwd_macs = np.array([u.macs_dx + u.macs_dw for u in staged.units], dtype=np.float64)
    b = np.zeros(n)
    arrived = np.nan_to_num(bwd_at, nan=t2)
    prev = tb
    for g in np.argsort(arrived):
        _split(np.float64(arrived[g] - prev), groups[g], bwd_macs, b)
        prev = arrived[g]
    return _unit_forward_ms(staged, groups, fwd_end, t0, t1), b * 1e3, (t1 - t0) * 1e3


SPLITS = ("macs", "plans")


def _plan_times(staged: StagedModel, x: Tensor, repeats: int,
                now: Callable[[], float]) -> tuple[np.ndarray, np.ndarray, float]:
    """Median ms of the sparse backward of every suffix plan {d..N-1} and single {d}, each
    after its own forward, as the engine runs it (a backward on a retained graph, right
    after another one, slightly faster: hot caches, no graph freeing),
    and the median of those forwards."""
    n = len(staged.units)
    groups = [u.parameters() for u in staged.units]
    suffix, single = np.zeros((repeats, n)), np.zeros((repeats, n))
    forwards: list[float] = []

    def timed(params: list) -> float:
        with torch.enable_grad():
            t0 = now()
            loss = staged.model(x).float().logsumexp(1).mean()
            t1 = now()
            torch.autograd.grad(loss, params)
            forwards.append((t1 - t0) * 1e3)
            return (now() - t1) * 1e3

    timed([p for g in groups for p in g])  # warm-up
    forwards.clear()
    for k in range(repeats):
        for d in range(n - 1, -1, -1):
            suffix[k, d] = timed([p for g in groups[d:] for p in g])
            single[k, d] = timed(groups[d])
    return np.median(suffix, axis=0), np.median(single, axis=0), float(np.median(forwards))


def fit_plan_times(suffix_ms: np.ndarray, single_ms: np.ndarray) -> tuple[np.ndarray, ...]:
    """(w, x) >= 0 minimising the squared error of the DESIGN §3 backward cost
    T_b'(S) = sum_{l in S} w_l + sum_{l > min S} x_l on the measured suffix plans
    {d..N-1} and single-unit plans {d}. x_0 never enters a cost (0 here); w_0 and x_1
    enter every cost and T only as their sum, which is returned in w_0 (x_1 = 0)."""
    from scipy.optimize import nnls

    suffix_ms, single_ms = np.asarray(suffix_ms, float), np.asarray(single_ms, float)
    n = suffix_ms.shape[0]
    if n < 1 or single_ms.shape != (n,) or not np.all(np.isfinite(suffix_ms)) \
            or not np.all(np.isfinite(single_ms)):
        raise ValueError(f"need finite suffix and single times of equal length, got "
                         f"{suffix_ms.shape} and {single_ms.shape}")
    a = np.zeros((2 * n, 2 * n - 1))  # columns: w_0..w_{n-1}, x_1..x_{n-1}
    for d in range(n):
        a[d, d:n] = 1.0
        a[n + d, d] = 1.0
        a[[d, n + d], n + d:] = 1.0  # sum_{l > d} x_l
    sol, _ = nnls(a, np.concatenate([suffix_ms, single_ms]))
    w, x = sol[:n].copy(), np.concatenate([[0.0], sol[n:]])
    if n > 1:
        w[0], x[1] = w[0] + x[1], 0.0
    return w, x


def profile_model(staged: StagedModel, batch: int = 4, repeats: int = 5,
                  input_shape: tuple[int, ...] | None = None,
                  split: str = "macs", inputs: torch.Tensor | None = None) -> UnitProfile:
    """Measure per-unit offline latencies of `staged` on its current device, on `inputs`
    (a batch of the user's images; its size then is the batch) or a random batch."""
    if inputs is not None:
        batch, input_shape = int(inputs.shape[0]), tuple(inputs.shape[1:])
    if batch < 1 or repeats < 1:
        raise ValueError(f"batch and repeats must be >= 1, got {batch}, {repeats}")
    if split not in SPLITS:
        raise ValueError(f"split {split!r} not in {SPLITS}")
    p = next(staged.model.parameters())
    shape = tuple(input_shape) if input_shape is not None else _input_shape(staged)
    now = _clock(p.device.type == "cuda")
    grad_state = {q: q.requires_grad for q in staged.model.parameters()}
    staged.model.requires_grad_(True)
    runs = []
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(batch, *shape, generator=gen) if inputs is None
             else inputs.detach()).to(p.device, p.dtype)
        nograd = []
        for i in range(repeats + 1):
            res = _one_run(staged, x, now)
            staged.model.zero_grad(set_to_none=True)
            r0 = _nograd_run(staged, x, now)
            if i > 0:  # the first run warms up allocators and kernels
                runs.append(res)
                nograd.append(r0)
        # the 2N plans cost 2N forwards + about N full backwards per repeat
        plans = _plan_times(staged, x, repeats, now) if split == "plans" else None
    finally:
        for q, flag in grad_state.items():
            q.requires_grad_(flag)
    g = np.median(np.stack([a for a, _, _ in runs]), axis=0)
    r = np.median(np.stack(nograd), axis=0)
    b = np.median(np.stack([bb for _, bb, _ in runs]), axis=0)
    forward_ms = float(np.median([f for _, _, f in runs]))
    if plans is not None:
        w_ms, x_ms = fit_plan_times(plans[0], plans[1])
        # the plans take minutes, and a shared machine drifts meanwhile: rescale the
        # forward references (r, g, T_f) to the forwards timed among the plans, so that the
        # forward feedback (predictor.feedback_pis) compares with the same moment as w, x
        # (relative to the sum of the per-unit medians, so that g sums to T_f exactly)
        scale = plans[2] / g.sum() if g.sum() > 0 else 1.0
        r, g, forward_ms = r * scale, g * scale, plans[2]
    else:
        dx = np.array([u.macs_dx for u in staged.units], dtype=np.float64)
        dw = np.array([u.macs_dw for u in staged.units], dtype=np.float64)
        frac_w = dw / np.maximum(dx + dw, 1.0)
        w_ms, x_ms = b * frac_w, b * (1 - frac_w)
    return UnitProfile(model=staged.arch, device=device_name(p.device), batch_size=batch,
                       input_shape=shape, unit_names=[u.name for u in staged.units],
                       w_ms=w_ms, x_ms=x_ms, r_ms=r, g_ms=g,
                       eta=np.array([u.eta for u in staged.units]),
                       forward_ms=forward_ms)


def _input_shape(staged: StagedModel) -> tuple[int, ...]:
    shape = getattr(staged, "input_shape", None)
    if shape is None:
        raise ValueError("input_shape is required (the StagedModel does not record it)")
    return tuple(shape)

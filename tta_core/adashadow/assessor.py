"""Backprop-free layer importance assessor of AdaShadow §3.1.

Each unit's output o is summarised by g(o) = per-channel mean and variance (first and
second moments, robust with small batches). The assessor keeps an exponential moving
average E^H of these embeddings and scores a unit by the mean over its channels of
KL(N(mu_H, var_H) || N(mu_e, var_e)), so units of different width are comparable. It only
reads statistics of the forward pass that already runs: no extra pass, no gradients.

Implementation: all units' statistics are concatenated into one flat vector (history is
kept flat too), so the KL is one elementwise op and the per-unit mean one segment sum,
instead of ~2 small kernels per unit (measured in benchmarks/speed/bench_assessor.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from tta_core.runtime.stats import channel_stats, gaussian_kl

Stats = Sequence[tuple[Tensor, Tensor]]


class Assessor:
    """EMA history of unit embeddings and KL importance per unit (AdaShadow Eq. 3)."""

    def __init__(self, n_units: int, alpha: float = 0.1, eps: float = 1e-5) -> None:
        if n_units < 1:
            raise ValueError(f"n_units must be >= 1, got {n_units}")
        if not (0.0 <= alpha <= 1.0):
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.n_units, self.alpha, self.eps = int(n_units), float(alpha), float(eps)
        self._sizes: list[int] | None = None
        self._mean: Tensor | None = None
        self._var: Tensor | None = None
        self._seeds: list[tuple[Tensor, Tensor] | None] | None = None
        self._seg: tuple | None = None  # (sizes list, sizes array, offsets) of _offsets

    # -- history -----------------------------------------------------------------------
    @property
    def history(self) -> list[tuple[Tensor, Tensor]] | None:
        """Per-unit (mean, var) of E^H, as views into the flat history; None before data."""
        if self._mean is None or self._var is None or self._sizes is None:
            return None
        return list(zip(self._mean.split(self._sizes), self._var.split(self._sizes), strict=True))

    def reset(self) -> None:
        """Forget the history; the next batch re-initialises it (from the seeds if any)."""
        self._sizes, self._mean, self._var = None, None, None

    def seed(self, seeds: Sequence[tuple[Tensor, Tensor] | None]) -> None:
        """Known source-domain stats per unit (None where unknown), used as the initial
        history: the first batch is then scored against the source instead of itself."""
        if len(seeds) != self.n_units:
            raise ValueError(f"expected seeds for {self.n_units} units, got {len(seeds)}")
        self._seeds = [None if s is None else (s[0].detach().clone(), s[1].detach().clone())
                       for s in seeds]

    def _flatten(self, stats: Stats) -> tuple[Tensor, Tensor, list[int]]:
        if len(stats) != self.n_units:
            raise ValueError(f"expected stats for {self.n_units} units, got {len(stats)}")
        sizes = [m.numel() for m, _ in stats]
        if self._sizes is not None and sizes != self._sizes:
            bad = next(i for i, (a, b) in enumerate(zip(sizes, self._sizes, strict=True)) if a != b)
            raise ValueError(
                f"unit {bad} has {sizes[bad]} channels, history has {self._sizes[bad]}"
            )
        with torch.no_grad():  # no graph: the concatenation is detached from the stats
            mean = torch.cat([m.reshape(-1) for m, _ in stats])
            var = torch.cat([v.reshape(-1) for _, v in stats])
        if mean.dtype != torch.float32:
            mean, var = mean.float(), var.float()
        return mean, var, sizes

    def _offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """Unit sizes and their start offsets in the flat vectors (cached per layout)."""
        if self._seg is None or self._seg[0] is not self._sizes:
            sizes = np.asarray(self._sizes)
            self._seg = (self._sizes, sizes, np.concatenate([[0], np.cumsum(sizes)[:-1]]))
        return self._seg[1], self._seg[2]

    def _init_from(self, mean: Tensor, var: Tensor, sizes: list[int]) -> None:
        self._sizes, self._mean, self._var = sizes, mean.clone(), var.clone()

    def _init_seeded(self, mean: Tensor, var: Tensor, sizes: list[int]) -> bool:
        """History = seeds where known, this batch elsewhere; False when there are no seeds."""
        if self._seeds is None or all(s is None for s in self._seeds):
            return False
        self._init_from(mean, var, sizes)
        assert self._mean is not None and self._var is not None
        hist = zip(self._mean.split(sizes), self._var.split(sizes), strict=True)
        for i, ((m, v), s) in enumerate(zip(hist, self._seeds, strict=True)):
            if s is not None:
                if s[0].numel() != sizes[i]:
                    raise ValueError(f"seed of unit {i} has {s[0].numel()} channels, "
                                     f"output has {sizes[i]}")
                m.copy_(s[0].reshape(-1))
                v.copy_(s[1].reshape(-1))
        return True

    # -- public API --------------------------------------------------------------------
    def importance(self, stats: Stats) -> np.ndarray:
        """a_l = mean_c KL(E^H_l,c || E^e_l,c); all zeros (and history set) on the first call."""
        mean, var, sizes = self._flatten(stats)
        if self._mean is None and not self._init_seeded(mean, var, sizes):
            self._init_from(mean, var, sizes)
            return np.zeros(self.n_units)
        return self._importance_flat(mean, var)

    def _importance_flat(self, mean: Tensor, var: Tensor) -> np.ndarray:
        assert self._mean is not None and self._var is not None and self._sizes is not None
        with torch.no_grad():
            kl = gaussian_kl(self._mean, self._var, mean, var, self.eps)
        kl_np = kl.double().cpu().numpy()
        sizes, offsets = self._offsets()
        # KL >= 0 exactly; clip float round-off so consumers (the planner) can rely on it
        return np.maximum(np.add.reduceat(kl_np, offsets) / sizes, 0.0)

    def update_history(self, stats: Stats) -> None:
        """E^H <- alpha * E^e + (1 - alpha) * E^H (initialised from the first batch)."""
        mean, var, sizes = self._flatten(stats)
        self._update_flat(mean, var, sizes)

    def _update_flat(self, mean: Tensor, var: Tensor, sizes: list[int]) -> None:
        if self._mean is None or self._var is None:
            self._init_from(mean, var, sizes)
            return
        with torch.no_grad():
            self._mean.mul_(1.0 - self.alpha).add_(mean, alpha=self.alpha)
            self._var.mul_(1.0 - self.alpha).add_(var, alpha=self.alpha)

    def step(self, stats: Stats) -> np.ndarray:
        """importance(stats) then update_history(stats), concatenating the stats once."""
        mean, var, sizes = self._flatten(stats)
        if self._mean is None and not self._init_seeded(mean, var, sizes):
            self._init_from(mean, var, sizes)
            return np.zeros(self.n_units)
        out = self._importance_flat(mean, var)
        self._update_flat(mean, var, sizes)
        return out

    # -- persistence (domain bank) -------------------------------------------------------
    def state_dict(self) -> dict:
        """A detached copy of the configuration and history."""
        return {
            "n_units": self.n_units,
            "alpha": self.alpha,
            "eps": self.eps,
            "sizes": None if self._sizes is None else list(self._sizes),
            "mean": None if self._mean is None else self._mean.detach().clone(),
            "var": None if self._var is None else self._var.detach().clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a state from `state_dict`; the unit count must match."""
        if int(state["n_units"]) != self.n_units:
            raise ValueError(f"state has n_units={state['n_units']}, assessor has {self.n_units}")
        sizes, mean, var = state["sizes"], state["mean"], state["var"]
        if sizes is None:
            self.reset()
        else:
            total = sum(sizes)
            if len(sizes) != self.n_units or mean.numel() != total or var.numel() != total:
                raise ValueError(f"inconsistent history: sizes sum {total}, mean {mean.numel()}")
            self._init_from(mean.detach().float(), var.detach().float(), list(sizes))
        self.alpha, self.eps = float(state["alpha"]), float(state["eps"])


def _bn_output_stats(bn: _BatchNorm, mean_x: Tensor, var_x: Tensor) -> tuple[Tensor, Tensor]:
    """Exact per-channel stats of BN(x) from those of x (x's stats are over the same dims)."""
    gamma = bn.weight if bn.weight is not None else torch.ones_like(mean_x)
    beta = bn.bias if bn.bias is not None else torch.zeros_like(mean_x)
    if bn.training or bn.running_mean is None or bn.running_var is None:
        # normalised with the biased batch statistics, which are exactly (mean_x, var_x)
        return torch.zeros_like(mean_x) + beta, gamma**2 * var_x / (var_x + bn.eps)
    scale = gamma / torch.sqrt(bn.running_var + bn.eps)
    return scale * (mean_x - bn.running_mean) + beta, scale**2 * var_x


class StatsRecorder:
    """Forward hooks that collect `channel_stats` of each unit's output during a forward.

    Cheaper but exact variant for Conv->BN pairs (`fuse_bn`): a BN's output statistics are
    a closed-form function of its input's (eval: affine with the running stats; train:
    mean = beta, var = gamma^2 v / (v + eps) with the batch variance v), and its input is the
    preceding conv's output. So one statistics pass per pair serves both units, halving the
    assessor's reads on ResNets (measured in benchmarks/speed/bench_assessor.py). At most one
    unit output is held at a time (flushed by the next hook), so no extra memory builds up.
    With `with_grad=False` the outputs are detached (fast kernel, no graph); with True the
    stats stay differentiable for `multilayer_kl_loss`.
    """

    def __init__(self, modules: Sequence[nn.Module], fuse_bn: bool = True,
                 with_grad: bool = False) -> None:
        self.modules = list(modules)
        self.fuse_bn, self.with_grad = fuse_bn, with_grad
        self._stats: list[tuple[Tensor, Tensor] | None] = [None] * len(self.modules)
        self._pending: tuple[int, Tensor] | None = None
        self._handles: list = []

    def _prep(self, t: Tensor) -> Tensor:
        return t if self.with_grad else t.detach()

    def _flush(self) -> None:
        if self._pending is not None:
            i, out = self._pending
            self._pending = None
            self._stats[i] = channel_stats(self._prep(out))

    def _hook(self, i: int, mod: nn.Module):
        is_bn = isinstance(mod, _BatchNorm)

        def hook(_m: nn.Module, args: tuple, out: Tensor | tuple) -> None:
            out = out[0] if isinstance(out, tuple) else out
            pending = self._pending
            if is_bn and pending is not None and args and args[0] is pending[1]:
                self._pending = None
                mean_x, var_x = channel_stats(self._prep(pending[1]))
                self._stats[pending[0]] = (mean_x, var_x)
                with torch.set_grad_enabled(self.with_grad and torch.is_grad_enabled()):
                    self._stats[i] = _bn_output_stats(mod, mean_x, var_x)
                return
            self._flush()
            if self.fuse_bn and not is_bn:
                self._pending = (i, out)
            else:
                self._stats[i] = channel_stats(self._prep(out))

        return hook

    @contextmanager
    def attach(self) -> Iterator[StatsRecorder]:
        """Register the hooks for the duration of the block (e.g. one forward pass)."""
        self._stats = [None] * len(self.modules)
        self._pending = None
        self._handles = [m.register_forward_hook(self._hook(i, m))
                         for i, m in enumerate(self.modules)]
        try:
            yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []

    def stats(self) -> list[tuple[Tensor, Tensor]]:
        """Per-unit (mean, var) of the last forward; raises if a unit did not run."""
        self._flush()
        missing = [i for i, s in enumerate(self._stats) if s is None]
        if missing:
            raise ValueError(f"units {missing} produced no output in the recorded forward")
        return list(self._stats)  # type: ignore[arg-type]

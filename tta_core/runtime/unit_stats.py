"""Where each unit's output statistics come from during the engine's forward.

The assessor needs per-channel (mean, var) of every unit's output (AdaShadow §3.1). Read
naively that is one extra pass over every activation, a sizeable share of a CPU forward.
Most of it is avoidable: in a Conv -> BatchNorm pair whose BN normalises by batch
statistics, the BN *already computes* the mean and variance of its input, the conv's output.
Running it with `momentum=1` and running stats tracked makes the BN leave exactly those
batch statistics in its running buffers (unbiased variance), which are not used for
normalisation in this mode. The BN's own output statistics then follow in closed form:
mean = beta and var = gamma^2 v / (v + eps). So pairs cost O(channels), not O(activations).

A Conv -> robust BN pair (RoTTA's robust BN, `tta_core.model.robust_bn`: an eval-mode BN
whose running statistics move toward each batch's first) costs the same: the controller's
update computes the batch statistics of the conv output anyway and records them, and the
eval BN's output statistics follow in closed form from its running statistics. Every
other unit (the classifier, LayerNorms, attention, convs without a BN) gets a forward hook.

The same pairs give the assessor a *source* history for free: a checkpoint's BN running
statistics are the source-domain statistics of the conv output, so importance is
meaningful from the first test batch instead of zero (see `source_seeds`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from tta_core.model.robust_bn import RobustBN
from tta_core.model.units import StagedModel
from tta_core.runtime.stats import channel_stats

Stats = tuple[Tensor, Tensor]


@dataclass
class _Pair:
    conv: int  # unit index of the conv
    bn: int  # unit index of the BN that normalises exactly the conv's output
    spatial: int  # elements per channel per sample of the conv output
    robust: RobustBN | None = None  # the BN's robust-BN controller (else batch statistics)


def _bn_output_stats(bn: _BatchNorm, var_x: Tensor) -> Stats:
    """Stats of BN(x) when BN normalises x by its own batch statistics."""
    gamma = bn.weight.detach() if bn.weight is not None else torch.ones_like(var_x)
    beta = bn.bias.detach() if bn.bias is not None else torch.zeros_like(var_x)
    return beta.clone(), gamma * gamma * var_x / (var_x + bn.eps)


def _eval_bn_output_stats(bns: list[_BatchNorm], means: list[Tensor], vars_: list[Tensor],
                          run_means: list[Tensor], run_vars: list[Tensor]) -> list[Stats]:
    """Stats of BN(x) per layer when eval-mode BNs normalise x (batch stats `means`, biased
    `vars_`) by running statistics (`run_means`, `run_vars`): a per-channel affine map of
    x. One dispatch per operation for all layers (torch._foreach_*), not ~6 small ops per
    layer."""
    if not bns:
        return []
    with torch.no_grad():
        gammas = [bn.weight.detach() if bn.weight is not None else torch.ones_like(m)
                  for bn, m in zip(bns, means, strict=True)]
        betas = [bn.bias.detach() if bn.bias is not None else torch.zeros_like(m)
                 for bn, m in zip(bns, means, strict=True)]
        scale = torch._foreach_add(run_vars, [bn.eps for bn in bns])
        torch._foreach_rsqrt_(scale)
        torch._foreach_mul_(scale, gammas)
        out_mean = torch._foreach_sub(means, run_means)
        torch._foreach_mul_(out_mean, scale)
        torch._foreach_add_(out_mean, betas)
        out_var = torch._foreach_mul(vars_, scale)
        torch._foreach_mul_(out_var, scale)
    return list(zip(out_mean, out_var, strict=True))


def find_conv_bn_pairs(staged: StagedModel) -> list[_Pair]:
    """Conv units whose output the next unit, a BatchNorm2d, reads unchanged: its
    `Unit.producer`, traced by `decompose` by tensor identity, not assumed from names, so
    unusual wiring simply falls back to hooks."""
    units = staged.units
    return [_Pair(u.producer, u.index, u.macs_fwd // (2 * u.module.num_features))
            for u in units  # a BN unit's macs_fwd: 2 per value of its (per-sample) input
            if u.kind == "bn" and isinstance(u.module, nn.BatchNorm2d)
            and u.producer is not None and units[u.producer].kind == "conv"]


def source_seeds(staged: StagedModel, source_bn: dict[str, Stats],
                 bn_input: bool = True) -> list[Stats | None]:
    """Per unit, the source-domain stats known from BN running stats (else None).

    `source_bn` maps BN unit names to the checkpoint's (running_mean, running_var), captured
    before the BN was switched to batch statistics. `bn_input`: BN units are described by
    their input's stats (see UnitStatsCollector), else by their output's.
    """
    seeds: list[Stats | None] = [None] * len(staged.units)
    units = staged.units
    for u in units:
        if u.kind != "bn" or u.name not in source_bn:
            continue
        mean, var = (t.detach().clone().float() for t in source_bn[u.name])
        if mean.shape != (u.module.num_features,) or var.shape != mean.shape:
            raise ValueError(f"source stats of {u.name!r} have shape {tuple(mean.shape)}, "
                             f"the layer has {u.module.num_features} channels")
        seeds[u.index] = (mean, var) if bn_input else _bn_output_stats(u.module, var)
        if u.index > 0 and units[u.index - 1].kind == "conv":
            seeds[u.index - 1] = (mean, var)
    return seeds


class UnitStatsCollector:
    """Per-unit stats of one forward: BN-carried for Conv->BN pairs, hooks elsewhere.

    A BN that normalises by batch statistics has an output whose statistics are (beta,
    gamma^2) whatever the input: no shift is visible there. Its importance is the shift it
    has to absorb, so such BN units are described by their *input* statistics (AdaShadow
    scores a layer by the divergence of what it sees; for a batch-normalised layer that is
    its input). Carriers and input statistics are used only when the stats need no
    gradient (the multi-layer KL loss differentiates output stats).
    """

    def __init__(self, staged: StagedModel, with_grad: bool) -> None:
        self.staged, self.with_grad = staged, with_grad
        self.bn_input = not with_grad  # batch-statistics BN units report their input stats
        self.pairs: list[_Pair] = []
        if not with_grad:
            self.pairs = [p for p in find_conv_bn_pairs(staged)
                          if self._carries(staged.units[p.bn].module, p)]
        for p in self.pairs:
            if p.robust is None:
                self._make_carrier(staged.units[p.bn].module)
        self._controllers = list({id(p.robust): p.robust for p in self.pairs
                                  if p.robust is not None}.values())
        carried = {i for p in self.pairs for i in (p.conv, p.bn)}
        self._stats: list[Stats | None] = [None] * len(staged.units)
        self._capture = False
        self._carried, self._closed = carried, False
        self._handles = self._install_hooks(carried)

    @staticmethod
    def _carries(bn: _BatchNorm, pair: _Pair) -> bool:
        """Whether the BN gives the pair's statistics: it normalises by batch statistics,
        or a robust-BN controller records them (then noted in `pair.robust`)."""
        pair.robust = getattr(bn, "_tta_robust", None) if not bn.training else None
        return bn.training or pair.robust is not None

    @property
    def capture(self) -> bool:
        """Whether the next forward's statistics are collected."""
        return self._capture

    @capture.setter
    def capture(self, value: bool) -> None:
        self._capture = bool(value)
        for ctl in self._controllers:
            ctl.record = self._capture

    def suspend(self) -> None:
        """Remove the hooks until `resume` (idempotent): a module with any hook takes
        PyTorch's slow call path, a small cost on every served batch, which a run of batches
        served without plan (nothing captured) need not pay."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def resume(self) -> None:
        """Put the hooks back after `suspend` (idempotent; not after `close`)."""
        if not self._handles and not self._closed:
            self._handles = self._install_hooks(self._carried)

    @staticmethod
    def _make_carrier(bn: _BatchNorm) -> None:
        """Track running stats with momentum 1: the buffers then hold the batch stats."""
        c = bn.num_features
        dev = bn.weight.device if bn.weight is not None else None
        if bn.running_mean is None:
            bn.running_mean = torch.zeros(c, device=dev)
            bn.running_var = torch.ones(c, device=dev)
            bn.num_batches_tracked = torch.tensor(0, dtype=torch.long, device=dev)
        bn.track_running_stats = True
        bn.momentum = 1.0

    def _install_hooks(self, carried: set[int]) -> list:
        by_module: dict[int, list[int]] = {}
        for u in self.staged.units:
            if u.index not in carried:
                by_module.setdefault(id(u.module), []).append(u.index)
        handles = []
        for u in self.staged.units:
            idx = by_module.pop(id(u.module), None)
            if idx is None:  # one hook per module (attention in/out share one)
                continue
            if self._reads_input(u.module):
                hook = self._hook(idx)
                handles.append(u.module.register_forward_pre_hook(
                    lambda m, args, hook=hook: hook(m, args, args[0])))
            else:
                handles.append(u.module.register_forward_hook(self._hook(idx)))
        return handles

    def _reads_input(self, mod: nn.Module) -> bool:
        return self.bn_input and isinstance(mod, _BatchNorm) and mod.training

    def _hook(self, idx: list[int]):
        def hook(_m, _args, out):
            if not self.capture:
                return None
            y = out[0] if isinstance(out, tuple) else out
            with torch.set_grad_enabled(self.with_grad):
                st = channel_stats(y if self.with_grad else y.detach())
            for i in idx:
                self._stats[i] = st
            if self.with_grad and not isinstance(out, tuple):
                # the KL loss differentiates the stats, so y must stay intact: hand a
                # copy downstream (torchvision's inplace ReLU / `out += identity`)
                return y.clone()
            return None
        return hook

    def collect(self, batch_size: int) -> list[Stats]:
        """Stats of the forward that just ran (call right after it, before any other)."""
        stats, self._stats = self._stats, [None] * len(self._stats)
        units = self.staged.units
        robust: list[tuple[int, _BatchNorm, Stats]] = []
        for p in self.pairs:
            bn = units[p.bn].module
            if p.robust is not None:
                recorded = p.robust.recorded.pop(id(bn), None)
                if recorded is not None:
                    stats[p.conv] = recorded[:2]
                    robust.append((p.bn, bn, recorded))
                continue
            n = batch_size * p.spatial
            var = bn.running_var * ((n - 1) / n) if n > 1 else torch.zeros_like(bn.running_var)
            stats[p.conv] = (bn.running_mean.clone(), var)
            stats[p.bn] = stats[p.conv] if self.bn_input else _bn_output_stats(bn, var)
        columns = ([r[k] for _, _, r in robust] for k in range(4))  # mean, var, running ones
        out = _eval_bn_output_stats([bn for _, bn, _ in robust], *columns)
        for (i, _, _), st in zip(robust, out, strict=True):
            stats[i] = st
        missing = [units[i].name for i, s in enumerate(stats) if s is None]
        if missing:
            raise RuntimeError(f"units did not run in the forward: {missing}")
        return stats  # type: ignore[return-value]

    def close(self) -> None:
        """Remove the hooks for good."""
        self.suspend()
        self._closed = True

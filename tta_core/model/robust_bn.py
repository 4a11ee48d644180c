"""BatchNorm statistics helpers shared by the methods: batch or running statistics per
layer, and RoTTA's robust BN (running statistics moved toward each batch's before they
normalise) used by AdaShadow's default `bn_mode="robust"` and DARDA's "bank" mode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from tta_kernels.bn_stats import fusable, library, normalise_update, update_stats


def batch_norm_layers(model: nn.Module) -> dict[str, _BatchNorm]:
    """BatchNorm modules by name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, _BatchNorm)}


def use_batch_stats(bn: _BatchNorm) -> None:
    """Normalise with batch statistics only (no running stats), as set_bn_mode('batch')."""
    bn.train()
    bn.track_running_stats = False
    bn.running_mean = None
    bn.running_var = None


def use_running_stats(bn: _BatchNorm) -> None:
    """Normalise with the running statistics (eval mode); they must exist."""
    if bn.running_mean is None or bn.running_var is None:
        raise ValueError(f"bn_mode 'bank' needs BN running statistics; {bn} has none")
    bn.eval()
    bn.track_running_stats = True


class RobustBN:
    """Moves eval-mode BN layers' running stats toward each batch's before they normalise
    (RoTTA RBN: mu <- (1 - m) mu + m mu_batch, same for the variance, the batch variance
    unbiased as PyTorch's BN keeps it), in one read of the layer's input
    (tta_kernels.bn_stats.update_stats: torch.batch_norm_update_stats's contract, in C for
    NCHW and channels-last float32 CPU tensors, PyTorch's own pass elsewhere).

    The layers' class is swapped for a subclass whose forward does the update (undone by
    `close`), not given a forward pre-hook: any hook sends a module down PyTorch's slow
    call path, 0.1 ms per small-net forward at batch 16 for 6 layers (2.5 %) even when
    the hook does nothing, which is what a batch served without update pays over
    bn_adapt. `isinstance`, state_dict and deepcopy see ordinary BN layers (a copy gets
    its own controller).

    lag: normalise with the statistics as they were before this batch, then move them (a
    one-batch lag on the momentum-m share of the batch), so a layer is normalised and its
    statistics taken in one read of its input (tta_kernels.bn_stats.normalise_update), the
    cost of a plain eval-mode BN, inside the recorded graph too (_LaggedEvalBN); RoTTA's
    order (lag False) reads the input twice. Layers on batch statistics (train mode) may
    be given too: they take them in one read and normalise in a second.

    batch_values K > 0: a layer whose input gives each channel at least K values (batch
    size x the layer's spatial size) normalises by that batch's statistics (Tent-style,
    the gradient through them), whether or not the controller is enabled; its running
    statistics still move when enabled, so a smaller batch later finds them current. The
    statistics of a few frames are noisy (robust BN's case), those of many values are
    not: the choice follows the batch, layer by layer (0: never).

    frames F > 0: `momentum` is the move of a batch of F frames, and a batch of n frames
    moves the statistics as n/F such batches (1 - (1 - m)^(n/F)), so their memory spans the
    same number of frames at every batch size: RoTTA's per-batch momentum (F = 0) at
    batch 64 forgets a short domain's statistics so slowly that the batches of the next one
    are normalised by the last one's, and at batch 4 so fast that a label-correlated stream's
    few classes carry them. A batch of more than F frames is not lagged (it moves the
    statistics by more than `momentum`, and a lag would normalise it by what it moves away
    from): RoTTA's order."""

    def __init__(self, layers: Sequence[_BatchNorm], momentum: float, lag: bool = False,
                 batch_values: int = 0, frames: int = 0) -> None:
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"bn momentum must be in [0, 1], got {momentum}")
        if isinstance(batch_values, bool) or not isinstance(batch_values, int) or not (
                batch_values == 0 or batch_values >= 2):
            raise ValueError(f"batch_values must be 0 (off) or an integer >= 2, got "
                             f"{batch_values!r}")
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 0:
            raise ValueError(f"frames must be an integer >= 0 (0: momentum per batch), got "
                             f"{frames!r}")
        self.batch_values, self.frames = batch_values, frames
        self.momentum, self.enabled, self.lag = float(momentum), True, bool(lag)
        self.stride, self.weight, self._count = 1, 1, 0
        # record: keep each layer's batch (mean, biased var) of a forward in `recorded`
        # (by id of the layer), the statistics the update computes anyway, with the
        # running (mean, var) the layer normalised by; AdaShadow's unit-statistics
        # collector reads them instead of a pass of its own per layer
        self.record = False
        self.recorded: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        # keep_inputs: keep each layer's input that the recorded graph saves anyway (by id
        # of the layer), for a reforward that starts at that layer (AdaShadow §4 reuse)
        self.keep_inputs = False
        self.inputs: dict[int, Tensor] = {}
        self._layers = list(layers)
        if self._layers:
            library()  # built (once per machine) or loaded now, not in a timed forward
        for bn in self._layers:  # a layer already under another controller: this one wins
            bn._tta_robust = self
            bn.__class__ = _robust_class(getattr(type(bn), "_tta_base", type(bn)))

    def due(self) -> int:
        """Thinning: with `stride` k > 1 only every k-th call returns k (this forward moves
        the statistics, standing for k batches), the others 0 (skip it). The caller passes
        the result as `weight`: the moved statistics decay per batch as with k = 1."""
        self._count += 1
        return self.stride if self._count % self.stride == 0 else 0

    def _move(self) -> bool:
        return self.enabled and self.momentum != 0.0

    def _momentum(self, x: Tensor) -> float:
        """The move of batch `x`: `momentum` per batch (frames 0) or per `frames` frames,
        times the thinning weight."""
        share = self.weight * (x.shape[0] / self.frames if self.frames else 1.0)
        return 1.0 - (1.0 - self.momentum) ** share  # share 1: self.momentum

    def _lagged(self, x: Tensor) -> bool:
        return self.lag and (not self.frames or x.shape[0] <= self.frames)

    def update(self, bn: _BatchNorm, x: Tensor,
               used: tuple[Tensor, Tensor] | None = None) -> None:
        """Move `bn`'s running statistics toward those of the batch `x` (when enabled);
        keep the batch statistics when recording, with `used`, the running statistics `bn`
        normalised by (None: the moved ones, RoTTA's order)."""
        if bn.training:
            return
        move = self._move()
        if not (move or self.record):
            return
        with torch.no_grad():  # one pass: the batch statistics, the buffers moved
            stats = update_stats(x.detach(), bn.running_mean if move else None,
                                 bn.running_var if move else None,
                                 self._momentum(x) if move else 0.0)
        if self.record:
            self.recorded[id(bn)] = (*stats, *(used or (bn.running_mean, bn.running_var)))

    def forward(self, bn: _BatchNorm, x: Tensor) -> Tensor:
        """`bn`'s output for `x`, its statistics moved (and recorded) in the order `lag`
        says: lagged, in one read of `x` (inside the recorded graph too, _LaggedEvalBN);
        RoTTA's order, or where the kernel does not take `x`, update and base forward. A
        layer on batch statistics (train mode) normalises by them, in two reads."""
        if bn.training:
            return _batch_stats_forward(bn, x)
        if self.on_batch_stats(x):
            return self._batch_forward(bn, x)
        grad = _needs_grad(bn, x)
        if grad and self.keep_inputs:
            self.inputs[id(bn)] = x
        if not self._lagged(x):
            self.update(bn, x)
            return bn._tta_base.forward(bn, x)
        if not (self._move() or self.record):
            return bn._tta_base.forward(bn, x)
        momentum, fused = self._momentum(x) if self._move() else 0.0, None
        if not grad:
            with torch.no_grad():
                fused = normalise_update(x, bn.running_mean, bn.running_var, momentum,
                                         bn.weight, bn.bias, bn.eps, self.record)
        elif fusable(x, bn.running_mean, bn.running_var, bn.weight, bn.bias):
            fused = _LaggedEvalBN.apply(x, bn.weight, bn.bias, bn, momentum)
        if fused is not None:  # (y, batch mean, var, running mean, var it normalised by)
            if self.record:
                self.recorded[id(bn)] = tuple(fused[1:5])
            return fused[0]
        # two passes, in the same order; a copy of the statistics it normalises by (one
        # launch for both: on a GPU the launches are the cost): for the record, and for a
        # backward, which would otherwise read the buffers the update moves in place after it
        used = (tuple(torch.stack((bn.running_mean, bn.running_var)).unbind(0))
                if self.record or grad else None)
        y = (F.batch_norm(x, *used, bn.weight, bn.bias, False, 0.0, bn.eps) if grad
             else bn._tta_base.forward(bn, x))
        self.update(bn, x, used)
        return y

    def on_batch_stats(self, x: Tensor) -> bool:
        """Whether an eval-mode layer normalises `x` by its batch statistics: at least
        `batch_values` values per channel (never with batch_values 0)."""
        return (self.batch_values > 0 and x.dim() >= 2
                and x.numel() >= self.batch_values * x.shape[1])

    def _batch_forward(self, bn: _BatchNorm, x: Tensor) -> Tensor:
        """`bn`'s output normalised by `x`'s batch statistics; the running statistics moved
        toward them when enabled; recorded as normalised by them (the assessor then sees
        the layer's output at the affine alone, as for a layer on batch statistics)."""
        move = self._move()
        if _needs_grad(bn, x):
            y = F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
            if move or self.record:
                with torch.no_grad():
                    stats = update_stats(x.detach(), bn.running_mean if move else None,
                                         bn.running_var if move else None,
                                         self._momentum(x) if move else 0.0)
                self._record_batch(bn, stats)
            return y
        with torch.no_grad():
            mean, var = update_stats(x, bn.running_mean if move else None,
                                     bn.running_var if move else None,
                                     self._momentum(x) if move else 0.0)
            self._record_batch(bn, (mean, var))
            return F.batch_norm(x, mean, var, bn.weight, bn.bias, False, 0.0, bn.eps)

    def _record_batch(self, bn: _BatchNorm, stats: tuple[Tensor, Tensor]) -> None:
        if self.record:
            self.recorded[id(bn)] = (*stats, *stats)

    def close(self) -> None:
        """Give the layers their own class back."""
        for bn in self._layers:
            if getattr(bn, "_tta_robust", None) is self:
                bn.__class__ = bn._tta_base
                del bn._tta_robust
        self._layers = []


class _LaggedEvalBN(torch.autograd.Function):
    """A lagged robust-BN layer inside the recorded graph in one read of its input: the
    fused kernel's eval-mode BN with the statistics before this batch, the buffers moved;
    the backward is PyTorch's eval-mode BN backward with the statistics before the move
    (the kernel hands them back). Outputs (y, batch mean, biased batch variance, running
    mean and variance used); only y carries a gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                bn: _BatchNorm, momentum: float) -> tuple[Tensor, ...]:
        y, *stats = normalise_update(x, bn.running_mean, bn.running_var, momentum, weight,
                                     bias, bn.eps, True)
        ctx.save_for_backward(x, weight, stats[2], stats[3])
        ctx.eps, ctx.affine = bn.eps, (weight is not None, bias is not None)
        ctx.mark_non_differentiable(*stats)
        return (y, *stats)

    @staticmethod
    def backward(ctx, grad_y: Tensor, *_stats: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, mean, var = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = [need[0], need[1] and ctx.affine[0], need[2] and ctx.affine[1]]
        none = x.new_empty(0)  # eval mode: no saved batch statistics (CUDA wants them empty)
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad_y, x, weight, mean, var, none, none, False, ctx.eps, mask)
        return gx, gw, gb, None, None


_ROBUST_CLASSES: dict[type, type] = {}


def _robust_forward(self: _BatchNorm, x: Tensor) -> Tensor:
    return self._tta_robust.forward(self, x)


def _batch_stats_forward(bn: _BatchNorm, x: Tensor) -> Tensor:
    """Train-mode BN (batch statistics; running ones, when tracked, moved by the layer's
    momentum) where no gradient is needed: the statistics in one read (update_stats), then
    eval-mode BN with them, two reads of `x` against PyTorch's three on channels-last
    input. The base forward elsewhere (a gradient, a cumulative average, one value per
    channel, which it refuses)."""
    track = bn.track_running_stats and bn.running_mean is not None
    if (_needs_grad(bn, x) or (track and bn.momentum is None)
            or x.dim() < 2 or x.numel() <= x.shape[1]):
        return bn._tta_base.forward(bn, x)
    bn._check_input_dim(x)
    with torch.no_grad():
        if track:
            bn.num_batches_tracked.add_(1)
        mean, var = update_stats(x, bn.running_mean if track else None,
                                 bn.running_var if track else None,
                                 float(bn.momentum) if track else 0.0)
        return F.batch_norm(x, mean, var, bn.weight, bn.bias, False, 0.0, bn.eps)


def _needs_grad(bn: _BatchNorm, x: Tensor) -> bool:
    """Whether autograd would record `bn`'s output for `x`."""
    return torch.is_grad_enabled() and (x.requires_grad or any(
        p is not None and p.requires_grad for p in (bn.weight, bn.bias)))


def _robust_class(base: type) -> type:
    """The subclass of a BN class whose forward first moves the statistics (cached)."""
    if base not in _ROBUST_CLASSES:
        _ROBUST_CLASSES[base] = type(base.__name__, (base,),
                                     {"forward": _robust_forward, "_tta_base": base,
                                      "__module__": base.__module__})
    return _ROBUST_CLASSES[base]

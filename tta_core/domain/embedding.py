"""Batch embedding for domain detection: channel moments of a few low BatchNorm inputs.

Low layers carry a corruption's "style" (noise raises the variance of edge filters, blur
lowers it, fog/contrast move the means). A batch is described by, for each chosen layer
(the model input and the inputs of the first `layers` BatchNorm layers in forward
order), per channel: the batch mean and the batch average of the per-sample log-variance
(over H, W). Both come from the activations the forward already produced (forward
pre-hooks: no extra pass). The per-sample log-variance is more robust to one odd image
than the log of the pooled variance; `per_sample=False` gives the pooled moments that
the AdaShadow assessor already collects (`embedding_from_stats`).

Recognition grows with the layers read (input only, conv1's output, the first stage's BN
inputs, every BN input; per-sample above pooled moments; benchmarks/domains/bench_domain.py),
the first stage giving most of it. Deeper layers are not used by default: their inputs
depend on the adapted and swapped BN state, which would make the embedding move with the
adaptation; the BN layers the embedding passes through are kept frozen in batch-statistics
mode by the darda method (`frozen_layers`).

Corruption residual (`residual`, on by default): the fixed part of DARDA's corruption
extractor (§4.1, Eqs. 3-4): the two diagonal 2x2 stride-2 downsamplings G1 = [[0, .5],
[.5, 0]] and G2 = [[.5, 0], [0, .5]] of the input agree on clean images (neighbouring
pixels are correlated) and the corruption breaks that; per sample and channel, the log
energy and the log kurtosis of G1(x) - G2(x), at full and half (2x2 average-pooled)
resolution: 12 more dimensions for RGB. The kurtosis separates impulse from Gaussian
noise and the two scales separate the blurs, which the BN moments merge. DARDA learns a
residual network g on top (Eqs. 3-5) and a contrastive encoder (Eqs. 6-8,
tta_core.domain.encoder); the fixed kernels alone raise online and enrolled recognition
and the share of held-out batches flagged novel (benchmarks/domains/bench_domain.py), Gaussian
blur and spatter most. Tried and dropped: horizontal and vertical differences as well
(spurious splits), a third scale, energies without the kurtosis (Gaussian blur no longer
told apart).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from tta_core.domain.encoder import diagonal_halves, load_encoder
from tta_core.runtime.stats import channel_stats

LOG_EPS = 1e-5  # added to variances before the log


@dataclass
class EmbeddingConfig:
    """Which moments make the embedding (see the module docstring)."""

    layers: int = 3  # first N BatchNorm layers (forward order) whose inputs are read
    include_input: bool = True  # also the moments of the model input itself
    per_sample: bool = True  # mean of per-sample log-var (else log of the pooled var)
    residual: bool = True  # + DARDA's fixed-kernel corruption residual of the input
    encoder: str = ""  # + DARDA's learnt corruption encoder (safetensors from
    #                    `tta train-corruption-encoder`; tta_core.domain.encoder); '' none

    def validate(self) -> None:
        """ValueError naming a bad field."""
        if self.layers < 0 or (self.layers == 0 and not (self.include_input or self.residual
                                                          or self.encoder)):
            raise ValueError(f"embedding needs at least one layer, got layers={self.layers} "
                             f"include_input={self.include_input} residual={self.residual} "
                             f"encoder={self.encoder!r}")


def bn_layers_in_forward_order(model: nn.Module, probe: Tensor) -> list[str]:
    """Names of the BatchNorm layers in the order a forward of `probe` runs them."""
    order: list[str] = []
    handles = [m.register_forward_pre_hook(lambda _m, _a, n=n: order.append(n))
               for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    was_training = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            model(probe)
    finally:
        for h in handles:
            h.remove()
        for m, t in was_training.items():
            m.train(t)
    return list(dict.fromkeys(order))


_CANCEL_RATIO = 1e3  # one-pass variance while mean^2 <= 1e3 var (as the assessor)


@dataclass
class Part:
    """One embedded layer's (moments, within-batch spread or None) of a forward, on the
    layer's device. `cancels`: a 0-dim bool, true when the one-pass variance of a channel
    cancelled; `exact()` then recomputes the moments two-pass. The embedder reads every
    part's flag and values in one transfer and calls `exact()` only on flagged parts."""

    vec: Tensor
    spread: Tensor | None
    cancels: Tensor | None = None
    exact: Callable[[], tuple[Tensor, Tensor | None]] | None = None


def _one_pass(v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Mean and population variance over the last dim of [B, C, N] in one pass
    (vector_norm for the squares, no temporary: 3.5 ms for a 16x64x112x112 ResNet-18 stem
    output on one core, var_mean 85 ms), and whether a channel cancels (0-dim bool)."""
    n = v.shape[-1]
    mean = v.sum(-1) / n
    var = torch.linalg.vector_norm(v, dim=-1) ** 2 / n - mean * mean
    return mean, var, ((mean * mean > _CANCEL_RATIO * var) | (var <= 0)).any()


def _two_pass(v: Tensor, mean: Tensor) -> tuple[Tensor, Tensor]:
    """Corrected two-pass mean and variance of [B, C, N] from the one-pass mean."""
    n = v.shape[-1]
    d = v - mean.unsqueeze(-1)
    shift = d.sum(-1) / n
    var = torch.linalg.vector_norm(d, dim=-1) ** 2 / n - shift * shift
    return mean + shift, var


def _features(mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor | None]:
    """Batch mean of the per-sample [channel means, log-variances], its spread / B."""
    feats = torch.cat([mean, torch.log(var.clamp_min(0) + LOG_EPS)], dim=1).double()
    n = feats.shape[0]
    return feats.mean(0), feats.var(0, correction=0) / n if n > 1 else None


def moments_part(x: Tensor, per_sample: bool) -> Part:
    """The moments of a [B, C, ...] tensor as a Part, float64 on x's device (`moments`)."""
    x = x.detach()
    if per_sample and x.ndim > 2:
        v = x.float().flatten(2)
        mean, var, cancels = _one_pass(v)
        return Part(*_features(mean, var), cancels, lambda: _features(*_two_pass(v, mean)))
    mean, var = channel_stats(x)
    return Part(torch.cat([mean, torch.log(var.clamp_min(0) + LOG_EPS)]).double(), None)


def moments(x: Tensor, per_sample: bool) -> tuple[Tensor, Tensor | None]:
    """([channel means, channel log-variances], within-batch spread of those or None) of a
    [B, C, ...] tensor, float64 on the CPU. Per sample: the log-variance is per sample and
    averaged; the spread is the variance over the batch of the per-sample features / B.
    One pass, two-pass where a channel would cancel."""
    part = moments_part(x, per_sample)
    vec, spread = part.vec, part.spread
    if part.cancels is not None and part.exact is not None and bool(part.cancels):
        vec, spread = part.exact()
    return vec.cpu(), None if spread is None else spread.cpu()


RESIDUAL_SCALES = 2  # full and half resolution
RESIDUAL_FEATURES = 2  # log energy, log kurtosis


def corruption_residual(x: Tensor) -> Tensor:
    """Per-sample [B, C * 4] features of G1(x) - G2(x) (module docstring), float64."""
    feats = []
    y = x.detach().float()
    for s in range(RESIDUAL_SCALES):
        if s:
            y = F.avg_pool2d(y, 2)
        g1, g2 = diagonal_halves(y)
        r = (g1 - g2).flatten(2)
        m2 = (r * r).mean(-1)
        m4 = (r * r * r * r).mean(-1)
        feats += [torch.log(m2 + LOG_EPS), torch.log(m4 / (m2 * m2 + LOG_EPS) + LOG_EPS)]
    return torch.cat(feats, 1).double()


def residual_moments(x: Tensor, per_sample: bool) -> tuple[Tensor, Tensor | None]:
    """(batch mean of `corruption_residual`, its spread / B or None), on x's device."""
    return sample_moments(corruption_residual(x), per_sample)


def sample_moments(f: Tensor, per_sample: bool) -> tuple[Tensor, Tensor | None]:
    """(batch mean of per-sample features [B, F], their spread / B or None), on f's
    device."""
    n = f.shape[0]
    spread = f.var(0, correction=0) / n if per_sample and n > 1 else None
    return f.mean(0), spread


def embedding_from_stats(stats: Sequence[tuple[Tensor, Tensor]]) -> Tensor:
    """The pooled-moment embedding from per-layer (mean, var), e.g. the assessor's stats
    of the same layers (AdaShadow's collector: BN input stats of Conv->BN pairs)."""
    parts = [torch.cat([m.detach().reshape(-1), torch.log(v.detach().reshape(-1)
                        .clamp_min(0) + LOG_EPS)]) for m, v in stats]
    return torch.cat(parts).double().cpu()


def read_parts(parts: Sequence[Part]) -> tuple[Tensor, Tensor | None]:
    """(concatenated vectors, concatenated spreads or None when a part has none), float64
    on the CPU, read from the device in one transfer (a second one only when a part's
    one-pass variance cancelled and it was recomputed two-pass)."""
    checked = [p for p in parts if p.cancels is not None]
    flags = [p.cancels for p in checked]
    host = _read([p.vec for p in parts], [p.spread for p in parts], flags)
    redo = [p for p, bad in zip(checked, host[2], strict=True) if bad]
    if redo:
        for p in redo:
            assert p.exact is not None
            p.vec, p.spread = p.exact()
            p.cancels = None
        host = _read([p.vec for p in parts], [p.spread for p in parts], [])
    return host[0], host[1]


def _read(vecs: list[Tensor], spreads: list[Tensor | None], flags: list[Tensor]
          ) -> tuple[Tensor, Tensor | None, list[bool]]:
    """One `tolist` of the vectors, the spreads (when every part has one) and the flags."""
    full = all(w is not None for w in spreads)
    pieces = [v.reshape(-1) for v in vecs] + \
        ([w.reshape(-1) for w in spreads if w is not None] if full else []) + \
        [f.reshape(1).double() for f in flags]
    values = torch.cat(pieces).tolist()
    dim = sum(v.numel() for v in vecs)
    vec = torch.tensor(values[:dim], dtype=torch.float64)
    spread = torch.tensor(values[dim:2 * dim], dtype=torch.float64) if full else None
    return vec, spread, [bool(f) for f in values[len(values) - len(flags):]]


class DomainEmbedder:
    """Forward pre-hooks on the chosen BN layers (and the model input) that keep the
    moments of the last forward; `embedding()` concatenates them."""

    def __init__(self, model: nn.Module, input_shape: Sequence[int],
                 config: EmbeddingConfig | None = None,
                 on_ready: Callable[[Tensor, Tensor | None], None] | None = None) -> None:
        """`on_ready(embedding, within)` is called inside the forward, in the pre-hook of the
        last embedded layer: before any later layer runs (darda swaps state there)."""
        self.on_ready = on_ready
        self.config = config if config is not None else EmbeddingConfig()
        self.config.validate()
        if len(input_shape) != 3:
            raise ValueError(f"input_shape must be one sample (C, H, W), got {tuple(input_shape)}")
        p = next(model.parameters())
        probe = torch.zeros((2, *input_shape), dtype=p.dtype, device=p.device)
        order = bn_layers_in_forward_order(model, probe)
        if len(order) < self.config.layers:
            raise ValueError(f"embedding wants {self.config.layers} BatchNorm layers, "
                             f"{type(model).__name__} has {len(order)}")
        self.layer_names: list[str] = order[: self.config.layers]
        modules = dict(model.named_modules())
        self._parts: dict[str, Part] = {}
        self._handles = [modules[n].register_forward_pre_hook(self._hook(n))
                         for n in self.layer_names]
        front = (["input"] if self.config.include_input else []) + \
            (["residual"] if self.config.residual else []) + \
            (["encoder"] if self.config.encoder else [])
        self.encoder = load_encoder(self.config.encoder).to(p.device) \
            if self.config.encoder else None
        self._handles[:0] = [model.register_forward_pre_hook(self._hook(k)) for k in front]
        self.keys = front + self.layer_names
        self.enabled = True
        self._ms = 0.0
        channels = sum(modules[n].num_features for n in self.layer_names)
        c_in = int(input_shape[0])
        self.dim = 2 * (channels + (c_in if self.config.include_input else 0)) + \
            (RESIDUAL_SCALES * RESIDUAL_FEATURES * c_in if self.config.residual else 0) + \
            (self.encoder.config.dim if self.encoder is not None else 0)

    def _hook(self, key: str):
        def hook(_m: nn.Module, args: tuple) -> None:
            if self.enabled and args and isinstance(args[0], Tensor):
                t0 = time.perf_counter()
                self._parts[key] = self._stat(key, args[0])
                ready = key == self.keys[-1] and self.on_ready is not None
                vec = self.embedding() if ready else None
                self._ms += (time.perf_counter() - t0) * 1e3
                if vec is not None and self.on_ready is not None:
                    self.on_ready(*vec)
        return hook

    def _stat(self, key: str, x: Tensor) -> Part:
        """One layer's part, left on the device (read with the others in `embedding`)."""
        if key == "residual":
            return Part(*residual_moments(x, self.config.per_sample))
        if key == "encoder":
            assert self.encoder is not None
            with torch.no_grad():
                z = self.encoder(x.detach().float()).double()
            return Part(*sample_moments(z, self.config.per_sample))
        return moments_part(x, self.config.per_sample)

    def take_ms(self) -> float:
        """Milliseconds spent computing moments since the last call (then reset)."""
        ms, self._ms = self._ms, 0.0
        return ms

    def embedding(self) -> tuple[Tensor, Tensor | None]:
        """The last forward's (embedding, within-batch spread or None), float64 on the CPU,
        read from the device in one transfer (`read_parts`); RuntimeError if a layer did
        not run."""
        missing = [k for k in self.keys if k not in self._parts]
        if missing:
            raise RuntimeError(f"layers {missing} did not run in the last forward")
        parts = [self._parts[k] for k in self.keys]
        self._parts.clear()
        return read_parts(parts)

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

"""DARDA's sub-network encoder S and the losses that tie it to the corruption space (§4.3,
§4.6): Eqs. 9-13 (offline) and Eq. 16 (online), plus the Eq. 10 choice of a sub-network.

- fingerprint F (§4.3): the model's logits on a fixed Gaussian-noise batch (eval mode, so
  the BN layers use the sub-network's running statistics), flattened; a different
  sub-network state gives a different response to the same input;
- S (`SubnetEncoder`): a shallow MLP from F to the unit sphere of the corruption latent
  space (the encoder h's, tta_core.domain.encoder);
- Eq. 9 `cm_loss`: sum of exp(-S^i . C^j) over the pairs; `pairs="diagonal"` (i = j,
  the default: each signature pulled onto its own centroid; S learns to copy the
  centroids, so Eq. 10's pick over the signatures finds the own sub-network, and Eq. 16
  starts near its floor on a training corruption) or `pairs="off_diagonal"` (the printed
  indicator i != j: each signature pulled toward the other corruptions' centroids, away
  from its own, so Eq. 10's arg max over i picks sub-networks of other corruptions);
- Eq. 10 `pi_matrix`: softmax_j of S^i . C^j / sum_k S^k . C^k (denominator floored at 1);
- Eq. 11 `alpha_matrix`: softmax_j of log(1/(1 - a_ij)) / sum_k log(1/(1 - a_ik)) from
  the accuracy a_ij of sub-network i on corruption j;
- Eq. 12 `reg_loss`: read as KL(alpha || pi) summed over rows (the printed sum of
  log(pi / alpha) is not a divergence and is unbounded below);
- Eq. 13 `subnet_loss` = L_CM + lambda_r L_r;
- Eq. 10 choice `closest`: the sub-network whose signature has the largest dot product
  with the batch's corruption signature (the row-wise normaliser of Eq. 10 is shared by
  every i, so the arg max over i of pi_ij is that of S^i . C^j);
- Eq. 16 `adaptation_loss`: exp(-S . C_bar), C_bar the mean corruption projection of the
  memory bank's samples; with S a unit vector its floor is exp(-|C_bar|), reached when S
  points along C_bar, where its gradient vanishes; `eq16_gradient` measures the loss and
  the gradient norm w.r.t. the adapted parameters at a sub-network state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

PAIRS = ("diagonal", "off_diagonal")  # Eq. 9 over i = j, and as printed (i != j)


def noise_batch(shape: tuple[int, ...], count: int, seed: int) -> Tensor:
    """The fixed Gaussian-noise input [count, *shape] (seeded, same on every machine)."""
    if count < 1 or len(shape) != 3:
        raise ValueError(f"noise needs count >= 1 and a (C, H, W) shape, got {count}, {shape}")
    g = torch.Generator().manual_seed(int(seed))
    return torch.randn(count, *shape, generator=g)


def fingerprint(model: nn.Module, noise: Tensor) -> Tensor:
    """F: the model's logits on `noise`, flattened (grad flows when enabled by the caller:
    the Eq. 16 step differentiates through it)."""
    return model(noise).flatten()


@dataclass
class SubnetEncoderConfig:
    """Shape of S (stored with its weights)."""

    in_dim: int
    dim: int = 32
    hidden: int = 64

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        for name in ("in_dim", "dim", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"subnet encoder {name}={getattr(self, name)} must be >= 1")


class SubnetEncoder(nn.Module):
    """S(F; psi): standardise F (a LayerNorm without affine), MLP, unit vector."""

    def __init__(self, config: SubnetEncoderConfig) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.norm = nn.LayerNorm(config.in_dim, elementwise_affine=False)
        self.net = nn.Sequential(nn.Linear(config.in_dim, config.hidden), nn.ReLU(),
                                 nn.Linear(config.hidden, config.dim))

    def forward(self, f: Tensor) -> Tensor:
        """Signatures [n, dim] (unit) of fingerprints [n, in_dim] (or one [in_dim] -> [dim])."""
        one = f.ndim == 1
        s = F.normalize(self.net(self.norm(f[None] if one else f)), dim=-1)
        return s[0] if one else s


def _check_pair(s: Tensor, c: Tensor) -> None:
    if s.ndim != 2 or c.ndim != 2 or s.shape != c.shape:
        raise ValueError(f"S and C must both be [d_s, dim], got {tuple(s.shape)} and "
                         f"{tuple(c.shape)}")


def cm_loss(s: Tensor, c: Tensor, pairs: str = "diagonal") -> Tensor:
    """Eq. 9: sum of exp(-S^i . C^j) over i != j ("off_diagonal", as printed) or over
    i = j ("diagonal")."""
    _check_pair(s, c)
    if pairs not in PAIRS:
        raise ValueError(f"cm_loss pairs {pairs!r} not in {PAIRS}")
    e = torch.exp(-(s @ c.T))
    eye = torch.eye(len(s), dtype=torch.bool, device=s.device)
    return e[eye].sum() if pairs == "diagonal" else e[~eye].sum()


def pi_matrix(s: Tensor, c: Tensor, floor: float = 1.0) -> Tensor:
    """Eq. 10: pi_ij = softmax_j(S^i . C^j / sum_k S^k . C^k); the denominator is clamped at
    `floor` (a sum of cosines: near 0 or negative for an untrained S, which would blow the
    logits up and saturate the softmax)."""
    _check_pair(s, c)
    denom = (s * c).sum().clamp_min(floor)
    return torch.softmax((s @ c.T) / denom, dim=1)


def alpha_matrix(a: Tensor, eps: float = 1e-6) -> Tensor:
    """Eq. 11: alpha_ij = softmax_j(log(1/(1 - a_ij)) / sum_k log(1/(1 - a_ik))); accuracies
    are clipped to [eps, 1 - eps] (an accuracy of 1 has an infinite log-odds weight)."""
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise ValueError(f"accuracy matrix must be square [d_s, d_s], got {tuple(a.shape)}")
    w = -torch.log1p(-a.clamp(eps, 1 - eps))
    return torch.softmax(w / w.sum(1, keepdim=True), dim=1)


def reg_loss(pi: Tensor, alpha: Tensor) -> Tensor:
    """Eq. 12 as KL(alpha || pi), summed over rows i."""
    if pi.shape != alpha.shape:
        raise ValueError(f"pi {tuple(pi.shape)} and alpha {tuple(alpha.shape)} differ in shape")
    return (alpha * (torch.log(alpha) - torch.log(pi.clamp_min(1e-30)))).sum()


def subnet_loss(s: Tensor, c: Tensor, a: Tensor, lambda_r: float = 0.5,
                pairs: str = "diagonal") -> Tensor:
    """Eq. 13: L_m = L_CM + lambda_r L_r (0 < lambda_r < 1 in the paper)."""
    return cm_loss(s, c, pairs) + lambda_r * reg_loss(pi_matrix(s, c), alpha_matrix(a))


def closest(signatures: Tensor, c: Tensor) -> int:
    """Eq. 10's choice: row i of `signatures` [d, dim] maximising S^i . c."""
    return int(closest_index(signatures, c))


def closest_index(signatures: Tensor, c: Tensor) -> Tensor:
    """`closest` as a 0-dim tensor on the device (not read back)."""
    if signatures.ndim != 2 or c.ndim != 1 or signatures.shape[1] != c.numel():
        raise ValueError(f"signatures [d, dim] and c [dim] expected, got "
                         f"{tuple(signatures.shape)} and {tuple(c.shape)}")
    return torch.argmax(signatures @ c)


def adaptation_loss(s: Tensor, c_bar: Tensor) -> Tensor:
    """Eq. 16: L_u = exp(-S . C_bar) (one signature, the memory bank's mean projection)."""
    if s.shape != c_bar.shape or s.ndim != 1:
        raise ValueError(f"S and C_bar must be vectors of one size, got {tuple(s.shape)} and "
                         f"{tuple(c_bar.shape)}")
    return torch.exp(-(s * c_bar).sum())


@dataclass
class Eq16Probe:
    """Eq. 16 at one sub-network state for one C_bar."""

    loss: float  # L_u = exp(-S . C_bar)
    floor: float  # exp(-|C_bar|): the least L_u of any unit S
    dot: float  # S . C_bar
    grad_norm: float  # L2 norm of dL_u / d(adapted parameters), all tensors together


def eq16_gradient(model: nn.Module, params: list[Tensor], s_enc: nn.Module, noise: Tensor,
                  c_bar: Tensor) -> Eq16Probe:
    """Eq. 16's loss and its gradient norm w.r.t. `params` (the adapted BN affine and dense
    tensors of `model`, in its current state and mode) for the fingerprint on `noise`
    through `s_enc` (S); nothing is updated and the tensors' requires_grad flags are restored."""
    if not params:
        raise ValueError("eq16_gradient needs at least one adapted parameter")
    flags = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(True)
        with torch.enable_grad():
            sig = s_enc(fingerprint(model, noise))
            loss = adaptation_loss(sig, c_bar)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for p, f in zip(params, flags, strict=True):
            p.requires_grad_(f)
    sq = sum(float(g.double().pow(2).sum()) for g in grads if g is not None)
    return Eq16Probe(float(loss.detach()), float(torch.exp(-c_bar.norm())),
                     float((sig.detach() * c_bar).sum()), sq ** 0.5)

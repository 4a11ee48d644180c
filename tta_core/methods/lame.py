"""LAME: Laplacian-adjusted maximum-likelihood estimation, output-only adaptation.

Boudiaf et al., "Parameter-free Online Test-time Adaptation", CVPR 2022.
The model is never changed (eval mode, source BN statistics). Per batch, the class
assignments Y minimise  sum_i KL(y_i || p_i) − lambda · sum_ij w_ij y_i^T y_j  over the
simplex, with p the model's softmax and W a kNN affinity (k = 5) between L2-normalised
penultimate features; solved by the paper's bound-optimisation fixed point
y_i ∝ p_i · exp(lambda · sum_j w_ij y_j) (≤ 100 iterations, relative tolerance 1e-8).
Features are the input of the model's last nn.Linear (ResNet fc, MobileNet classifier,
ViT head). The solve is reported as the phase "post" (res.times.post_ms).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tta_core.registry import register
from tta_core.runtime.method import MethodConfig, Step, TTAMethod
from tta_core.runtime.options import option

AFFINITIES = ("knn", "rbf", "linear")


@dataclass
class LAMEConfig(MethodConfig):
    """LAME settings (paper / reference code defaults)."""

    affinity: str = option("knn", "affinity between the batch's features: knn, rbf or "
                           "linear (cosine)", choices=AFFINITIES)
    knn: int = option(5, "neighbours of the knn affinity (and the rbf bandwidth)", low=1)
    bound_lambda: float = option(1.0, "weight lambda of the Laplacian term", low=0.0)
    max_steps: int = option(100, "most fixed-point iterations of the assignment solve",
                            low=1)
    force_symmetry: bool = option(False, "symmetrise the affinity matrix (W + W^T) / 2")


def affinity_matrix(feats: Tensor, kind: str, knn: int) -> Tensor:
    """[N, N] affinity of L2-normalised features: kNN (0/1, self excluded), RBF with the
    mean k-th neighbour distance as bandwidth, or linear (cosine)."""
    if kind not in AFFINITIES:
        raise ValueError(f"affinity {kind!r} not in {AFFINITIES}")
    if kind == "linear":
        return feats @ feats.t()
    n = feats.shape[0]
    dist = torch.cdist(feats, feats)
    if kind == "rbf":
        sigma = dist.topk(min(knn, n), dim=-1, largest=False).values[:, -1].mean()
        return torch.exp(-dist ** 2 / (2 * sigma ** 2 + 1e-12))
    idx = dist.topk(min(knn + 1, n), dim=-1, largest=False).indices[:, 1:]
    return torch.zeros(n, n, dtype=feats.dtype, device=feats.device).scatter_(1, idx, 1.0)


def laplacian_optimization(unary: Tensor, kernel: Tensor, bound_lambda: float = 1.0,
                           max_steps: int = 100) -> tuple[Tensor, int]:
    """Fixed-point iterations of LAME; unary = −log p [N, K]. Returns (Y, iterations)."""
    y = (-unary).softmax(-1)
    old = float("inf")
    steps = 0
    for steps in range(1, max_steps + 1):
        pairwise = bound_lambda * kernel @ y
        y = (-unary + pairwise).softmax(-1)
        energy = float((unary * y - bound_lambda * pairwise * y
                        + y * torch.log(y.clamp_min(1e-20))).sum())
        if steps > 2 and abs(energy - old) <= 1e-8 * abs(old):
            break
        old = energy
    return y, steps


def last_linear(model: nn.Module) -> nn.Linear:
    """The model's last nn.Linear in registration order (its classifier)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no nn.Linear classifier for LAME")
    return linears[-1]


@register("lame")
class LAME(TTAMethod):
    """Output-only adaptation: Laplacian-regularised assignments; no parameter changes."""

    config_cls = LAMEConfig
    config: LAMEConfig

    def configure_model(self) -> None:
        if self.config.affinity not in AFFINITIES:
            raise ValueError(f"affinity {self.config.affinity!r} not in {AFFINITIES}")
        if self.config.knn < 1:
            raise ValueError(f"knn must be >= 1, got {self.config.knn}")
        self.model.eval()
        self.model.requires_grad_(False)
        self._feats: Tensor | None = None
        last_linear(self.model).register_forward_pre_hook(self._grab)

    def _grab(self, _m: nn.Module, args: tuple) -> None:
        self._feats = args[0]

    def post(self, step: Step) -> None:
        """The Laplacian-regularised assignment of the batch's features (output only)."""
        feats, self._feats = self._feats, None
        c = self.config
        with torch.no_grad():
            unary = -torch.log(step.logits.float().softmax(1) + 1e-10)
            kernel = affinity_matrix(F.normalize(feats.float().flatten(1), dim=-1),
                                     c.affinity, c.knn)
            if c.force_symmetry:
                kernel = 0.5 * (kernel + kernel.t())
            y, step.stats["iterations"] = laplacian_optimization(unary, kernel, c.bound_lambda,
                                                                 c.max_steps)
        step.logits = torch.log(y.clamp_min(1e-20))

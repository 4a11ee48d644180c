"""ElasticDNN's domain knowledge Θ* (§III-B1 Eq. 1) and the master update through it
(§III-B3 Eqs. 3-4).

For every conv layer i a surrogate can change (each gated conv and the conv reading it),
Θ*_i holds K_i weight matrices θ*_ik of the filters' format (C_in, kh, kw) and an (N_i, K_i)
relevance matrix w_i, tied to the master's filters by the second pre-training loss

    tie = Σ_i Σ_j ‖θ_ij − Σ_k w_i(j, k) θ*_ik‖²                         (§III-B1)

Eq. 1 lists N_i matrices; `share` sets K_i = ceil(share · N_i), and the pre-training
(`tta train-elastic`, default share 1/4) trains K_i < N_i jointly with the task loss. A fit
starts from the filters' SVD, θ_i = U S Vᵀ, in one of two gauges (the tie cannot tell them
apart: w A, A⁻¹ Θ* tie as well for any invertible A, but Eqs. 3-4 can):

- "orthonormal": w_i = U[:, :K], θ*_i = S[:K] Vᵀ[:K] (`--knowledge-only` fits, K = N);
- "similarity" (the pre-training's start): w_i = U[:, :K] S[:K] / s̄, θ*_i = s̄ Vᵀ[:K],
  s̄² the mean of S[:K]²: w_i(j, k) is filter j's projection on the k-th principal filter,
  so w wᵀ is the filters' Gram matrix at rank K (trace K, as the orthonormal projector's).
  The paper does not say how w starts; this reading makes "relevance" a similarity.

Both are the least-squares optimum of the tie for that K, 0 up to float error when K = N.

The master update stores a surrogate's change Δθ_ij into Θ* (Eq. 3, for all j at once:
θ*_i += w_iᵀ Δθ_i) and rewrites the layer's filters from it (Eq. 4: θ_i = w_i θ*_i), one
layer at a time. With the tie exact the master moves by w_i w_iᵀ Δθ_i: the whole change
for orthonormal relevances with K = N (w wᵀ = I), a projection for orthonormal K < N, and
for relevances trained from the similarity gauge a filter's change spreads to the filters
related to it by (w wᵀ)_lj.

Θ* is a submodule ``knowledge`` of the gated master (buffers-like parameters that never
require grad outside `train-elastic`), so it travels in the master's state_dict and
safetensors checkpoint (keys ``knowledge.theta.<layer>``, ``knowledge.w.<layer>``); the
model card's factory kwarg ``knowledge`` (the share) builds it empty before loading.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from pathlib import Path

import safetensors.torch
import torch
from torch import Tensor, nn

from tta_core.elasticdnn.gates import GatedModel, gate_key, save_gated
from tta_core.model.source import ModelCard, load_card, save_card

log = logging.getLogger(__name__)
KNOWLEDGE_KEY = "knowledge"  # the submodule's name on the master and the card kwarg
KNOWLEDGE_GAUGES = ("orthonormal", "similarity")  # DomainKnowledge.fit (module doc)


def knowledge_layers(master: GatedModel) -> tuple[str, ...]:
    """Names (in `master.base`) of the convs a surrogate changes: each gated conv and the
    conv reading its output, in execution order."""
    names: list[str] = []
    for s in master.sites:
        names += [n for n in (s.conv, s.next_conv) if n not in names]
    return tuple(names)


def knowledge_rank(share: float, filters: int) -> int:
    """K = ceil(share · N) knowledge matrices for a layer of N filters; ValueError naming
    `share` unless it is in (0, 1]."""
    if not 0.0 < share <= 1.0:
        raise ValueError(f"knowledge share must be in (0, 1], got {share}")
    return max(1, min(filters, math.ceil(share * filters - 1e-9)))


class DomainKnowledge(nn.Module):
    """Θ* and the relevances w of the layers `layers` of a master (module doc)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], share: float = 1.0) -> None:
        super().__init__()
        self.layers = tuple(shapes)
        self.share = float(share)
        self.theta = nn.ParameterDict()
        self.w = nn.ParameterDict()
        for name, shape in shapes.items():
            k = knowledge_rank(share, shape[0])
            self.theta[gate_key(name)] = nn.Parameter(torch.zeros(k, *shape[1:]),
                                                      requires_grad=False)
            self.w[gate_key(name)] = nn.Parameter(torch.zeros(shape[0], k), requires_grad=False)

    def relevances(self, layer: str) -> Tensor:
        """w_i (N_i, K_i) of `layer`."""
        return self.w[gate_key(layer)]

    def matrices(self, layer: str) -> Tensor:
        """Θ*_i (K_i, C_in, kh, kw) of `layer`."""
        return self.theta[gate_key(layer)]

    def combine(self, layer: str) -> Tensor:
        """Σ_k w_i(j, k) θ*_ik for every filter j of `layer`: (N_i, C_in, kh, kw)."""
        theta = self.matrices(layer)
        return (self.relevances(layer) @ theta.reshape(len(theta), -1)).reshape(
            -1, *theta.shape[1:])

    def tie_loss(self, base: nn.Module) -> Tensor:
        """The second pre-training loss Σ_i Σ_j ‖θ_ij − Σ_k w_i(j,k) θ*_ik‖² over `base`
        (differentiable in the filters, Θ* and w)."""
        mods = dict(base.named_modules())
        terms = [(mods[n].weight - self.combine(n)).pow(2).sum() for n in self.layers]
        return torch.stack(terms).sum()

    @torch.no_grad()
    def fit(self, base: nn.Module, gauge: str = "orthonormal") -> None:
        """w_i, Θ*_i from the SVD of each layer's filters in `gauge` (module doc)."""
        if gauge not in KNOWLEDGE_GAUGES:
            raise ValueError(f"knowledge gauge must be one of {KNOWLEDGE_GAUGES}, got {gauge!r}")
        mods = dict(base.named_modules())
        for n in self.layers:
            weight = mods[n].weight.detach()
            flat = weight.reshape(len(weight), -1).double()
            u, s, vh = torch.linalg.svd(flat, full_matrices=True)
            k = self.relevances(n).shape[1]
            sv = flat.new_zeros(k)
            sv[:min(k, len(s))] = s[:k]
            basis = vh[:k] if k <= vh.shape[0] else torch.cat(
                [vh, flat.new_zeros(k - vh.shape[0], vh.shape[1])])
            scale = sv.new_ones(k)  # orthonormal: w = U_K, Θ* = S_K V_Kᵀ
            if gauge == "similarity" and float(sv.pow(2).mean()) > 0:
                scale = sv / sv.pow(2).mean().sqrt()  # w = U_K S_K / s̄, Θ* = s̄ V_Kᵀ
            self.relevances(n).copy_(u[:, :k] * scale)
            self.matrices(n).copy_(((sv / torch.where(scale > 0, scale, 1))[:, None] * basis)
                                   .reshape(k, *weight.shape[1:]))

    @torch.no_grad()
    def orthonormalize(self) -> None:
        """Re-gauge every layer to orthonormal relevances, w = Q R → w ← Q, Θ* ← R Θ*: the
        combinations (and the tie) unchanged, Eqs. 3-4 then a projection (w wᵀ = Q Qᵀ)."""
        for n in self.layers:
            theta, w = self.matrices(n), self.relevances(n)
            q, r = torch.linalg.qr(w.double())
            flat = r @ theta.reshape(len(theta), -1).double()
            w.copy_(q)
            theta.copy_(flat.reshape(theta.shape))

    @torch.no_grad()
    def project(self, base: nn.Module) -> None:
        """Each knowledge layer's filters set to their combinations, θ_i ← w_i Θ*_i: the
        tie exact (the pre-training's end state, §III-B1), at rank K_i when K_i < N_i."""
        mods = dict(base.named_modules())
        for n in self.layers:
            self.recall(n, mods[n].weight)

    @torch.no_grad()
    def solve(self, base: nn.Module) -> None:
        """Θ*_i by least squares for the current w_i and filters (exact when w_i is
        invertible): the tie's optimum for fixed relevances."""
        mods = dict(base.named_modules())
        for n in self.layers:
            flat = mods[n].weight.detach().reshape(len(self.relevances(n)), -1).double()
            sol = torch.linalg.lstsq(self.relevances(n).double(), flat).solution
            self.matrices(n).copy_(sol.reshape(self.matrices(n).shape))

    @torch.no_grad()
    def store(self, layer: str, delta: Tensor) -> None:
        """Eq. 3 for every filter j of `layer`: θ*_ik += Σ_j w_i(j, k) Δθ_ij; `delta` has the
        layer's weight shape (zeros where nothing changed)."""
        theta, w = self.matrices(layer), self.relevances(layer)
        if delta.shape[0] != w.shape[0] or delta.shape[1:] != theta.shape[1:]:
            raise ValueError(f"delta of {layer} has shape {tuple(delta.shape)}, expected "
                             f"({w.shape[0]}, {', '.join(map(str, theta.shape[1:]))})")
        upd = w.t() @ delta.reshape(len(delta), -1).to(theta.dtype)
        theta.add_(upd.reshape(theta.shape))

    @torch.no_grad()
    def recall(self, layer: str, weight: Tensor) -> None:
        """Eq. 4 for every filter j of `layer`: θ_ij ← Σ_k w_i(j, k) θ*_ik, into `weight`."""
        weight.copy_(self.combine(layer).to(weight.dtype))


def knowledge_shapes(master: GatedModel) -> dict[str, tuple[int, ...]]:
    """Weight shape of every knowledge layer of `master`."""
    mods = dict(master.base.named_modules())
    return {n: tuple(mods[n].weight.shape) for n in knowledge_layers(master)}


def attach_knowledge(master: GatedModel, share: float = 1.0, fit: bool = True,
                     gauge: str = "orthonormal") -> DomainKnowledge:
    """Give `master` a Θ* (submodule ``knowledge``), fitted to its filters in `gauge`
    unless `fit` is False (then zeros, for a checkpoint to fill in); returns it."""
    kn = DomainKnowledge(knowledge_shapes(master), share)
    ref = next(master.base.parameters())
    kn.to(device=ref.device, dtype=ref.dtype)
    if fit:
        kn.fit(master.base, gauge)
    master.add_module(KNOWLEDGE_KEY, kn)
    return kn


def knowledge_of(master: nn.Module) -> DomainKnowledge | None:
    """The master's Θ*, None when it has none (a checkpoint written before Θ*)."""
    kn = getattr(master, KNOWLEDGE_KEY, None)
    return kn if isinstance(kn, DomainKnowledge) else None


def require_knowledge(master: GatedModel, what: str = "the master") -> DomainKnowledge:
    """The master's Θ*, or one fitted now (share 1) with a one-line warning: a checkpoint
    written before Θ* existed is converted, not refused (the fit is the tie's optimum)."""
    kn = knowledge_of(master)
    if kn is not None:
        return kn
    kn = attach_knowledge(master)
    log.warning("%s has no domain knowledge Θ* (a checkpoint from before Eq. 1): fitted "
                "from its filters, tie loss %.2e; `tta train-elastic --knowledge-only` "
                "stores one", what, float(kn.tie_loss(master.base).detach()))
    return kn


@torch.no_grad()
def absorb(master: GatedModel, layers: Iterable[str] | None = None) -> None:
    """Eqs. 3-4 for a master changed in place (it served and adapted itself): its drift
    from Θ*, Δθ = θ − Σ_k w θ*, is stored and the filters rewritten from Θ*."""
    kn = require_knowledge(master)
    mods = dict(master.base.named_modules())
    for n in kn.layers if layers is None else layers:
        weight = mods[n].weight
        kn.store(n, weight.detach() - kn.combine(n).to(weight.dtype))
        kn.recall(n, weight)


def save_master(master: GatedModel, path: str | Path, source_card: ModelCard,
                clean_accuracy: float = float("nan"),
                metadata: dict[str, str] | None = None, half: bool = False) -> Path:
    """`save_gated`, plus the card kwarg ``knowledge`` (Θ*'s share) when the master has Θ*,
    so the card's factory builds Θ* before the checkpoint is loaded; with `half` every
    float tensor is stored as float16 (they load into the float32 model). Returns the card
    path."""
    card_path = save_gated(master, path, source_card, clean_accuracy, metadata)
    kn = knowledge_of(master)
    if kn is not None:
        card = load_card(card_path)
        card.kwargs = {**card.kwargs, KNOWLEDGE_KEY: kn.share}
        save_card(card, card_path)
    if half:
        weights = Path(card_path).parent / load_card(card_path).checkpoint
        state = safetensors.torch.load_file(str(weights))
        state = {k: v.half() if v.is_floating_point() else v for k, v in state.items()}
        safetensors.torch.save_file(state, str(weights), metadata=dict(metadata or {}))
    return card_path

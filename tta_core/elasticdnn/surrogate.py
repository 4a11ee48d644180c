"""Surrogate extraction: a dense sub-network of the gated master for one domain.

From one representative sample x* (the highest-entropy sample of a batch, as in the paper;
the authors' code takes the first), each gated conv keeps its top `keep` share of filters
by gate value on x*; conv rows, BN channels and the next conv's input channels are sliced
physically (a plain copy of the base, no pruning library, no gates left), and the kept gate
values are folded into the BN's gamma and beta (see gates.py: the gate scales the BN output).

Exactness on x*: the gates are evaluated with the master at sparsity
``max(master.sparsity, 1 - keep)``, every channel whose gate is non-zero there is kept, and a
zero gate makes its channel exactly 0 for the next conv. So ``surrogate(x*)`` equals the
master run at that sparsity on x* (up to float summation order). It equals the master at
its *own* sparsity whenever `keep` is at least each gate's active share on x* (non-zero
gates / channels); below that the surrogate drops channels the master uses and reproduces
the sparser master (sparsity 1 - keep) instead, which the sandwich-trained master serves at
a small loss (tta_core.elasticdnn.train).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from tta_core.elasticdnn.gates import GatedModel, GateSite, fold_extra_gates, kept_count


@dataclass
class Surrogate:
    """A dense network cut from the master for one domain, and where it came from."""

    model: nn.Module  # plain dense sliced network, no gates (gates folded into BN)
    keep: float  # share of filters kept per gated conv
    kept: dict[str, Tensor]  # gated conv name -> kept output-channel indices (sorted)
    sites: tuple[GateSite, ...] = ()
    # gated conv name -> the gate values on x* folded into its BN (kept channels)
    scale: dict[str, Tensor] = field(default_factory=dict)
    # the sliced parameters and BN buffers at extraction (write-back applies the change)
    origin: dict[str, Tensor] = field(default_factory=dict)
    master_sparsity: float = 0.0  # the master's sparsity surrogate(x*) reproduces

    def sliced_names(self) -> tuple[str, ...]:
        """Names (in `model`) of the parameters and buffers slicing changed."""
        return tuple(self.origin)


def _entropy(logits: Tensor) -> Tensor:
    logp = torch.log_softmax(logits.float(), dim=1)
    return -(logp.exp() * logp).sum(dim=1)


@torch.no_grad()
def highest_entropy_sample(master: GatedModel, batch: Tensor) -> Tensor:
    """The sample of `batch` (N, C, H, W) whose prediction by the master (eval mode, its
    current sparsity) has the highest entropy, as (1, C, H, W)."""
    if batch.ndim != 4 or len(batch) == 0:
        raise ValueError(f"batch must be a non-empty (N, C, H, W) tensor, got shape "
                         f"{tuple(batch.shape)}")
    was_training = master.training
    master.eval()
    try:
        i = int(torch.argmax(_entropy(master(batch))))
    finally:
        master.train(was_training)
    return batch[i:i + 1]


def _choose(values: Tensor, saliency: Tensor, keep: float) -> Tensor:
    """Sorted indices of the kept channels of one gate on x*: every channel with a non-zero
    gate value, then the highest saliencies, ceil(keep * C) in all."""
    k = kept_count(keep, len(values))
    active = values > 0
    if int(active.sum()) > k:
        raise AssertionError(f"{int(active.sum())} active gates > {k} kept")
    order = torch.argsort(saliency, descending=True, stable=True)
    order = order[torch.argsort((~active[order]).to(torch.int8), stable=True)]
    return torch.sort(order[:k]).values


def _slice(model: nn.Module, site: GateSite, idx: Tensor, scale: Tensor) -> None:
    """Keep channels `idx` of `site`'s conv and BN and of the next conv's input, in place;
    fold `scale` (the gate values) into the BN's gamma and beta."""
    mods = dict(model.named_modules())
    conv, bn, nxt = mods[site.conv], mods[site.bn], mods[site.next_conv]
    conv.weight = nn.Parameter(conv.weight.detach()[idx].clone())
    if conv.bias is not None:
        conv.bias = nn.Parameter(conv.bias.detach()[idx].clone())
    conv.out_channels = len(idx)
    s = scale.to(bn.weight.dtype)
    bn.weight = nn.Parameter(bn.weight.detach()[idx] * s)
    bn.bias = nn.Parameter(bn.bias.detach()[idx] * s)
    if bn.running_mean is not None:
        bn.running_mean = bn.running_mean[idx].clone()
        bn.running_var = bn.running_var[idx].clone()
    bn.num_features = len(idx)
    nxt.weight = nn.Parameter(nxt.weight.detach()[:, idx].clone())
    nxt.in_channels = len(idx)


def _match_format(model: nn.Module, master: GatedModel) -> None:
    """Slicing leaves NCHW weights: run the surrogate in the master's memory format (a
    method converts the master to channels_last where that is faster; the sliced odd
    channel counts gain the most from it, tta_core.model.memory_format)."""
    conv = next((m for m in master.modules() if isinstance(m, nn.Conv2d)), None)
    w = conv.weight if conv is not None else None
    if w is not None and w.ndim == 4 and not w.is_contiguous() and w.is_contiguous(
            memory_format=torch.channels_last):
        model.to(memory_format=torch.channels_last)


def _origin(model: nn.Module, sites: tuple[GateSite, ...]) -> dict[str, Tensor]:
    """Copies of the sliced tensors (gated conv weight and bias, BN params and running
    statistics, next conv weight), by their names in `model`."""
    names = {f"{m}.{t}" for s in sites for m in (s.conv, s.bn)
             for t in ("weight", "bias", "running_mean", "running_var")}
    names |= {f"{s.next_conv}.weight" for s in sites}
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    return {n: tensors[n].detach().clone() for n in sorted(names) if n in tensors}


def extract_surrogate(master: GatedModel, sample: Tensor, keep: float) -> Surrogate:
    """The dense surrogate keeping `keep` of every gated conv's filters, chosen by the gate
    values on `sample` (1, C, H, W); its mode follows the master's. See the module doc for
    when ``surrogate.model(sample)`` equals ``master(sample)`` (within float error)."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    if sample.ndim != 4 or len(sample) != 1:
        raise ValueError(f"sample must be (1, C, H, W), got shape {tuple(sample.shape)}")
    was_training = master.training
    sparsity = max(master.sparsity, 1.0 - keep)
    master.eval()
    try:
        with master.sparsity_set_to(min(sparsity, 1.0 - 1e-9)):
            values, saliency = master.gates_on(sample)
    finally:
        master.train(was_training)
    model = master.plain_base()
    kept, scale = {}, {}
    for site in master.sites:
        idx = _choose(values[site.conv][0], saliency[site.conv][0], keep)
        kept[site.conv], scale[site.conv] = idx, values[site.conv][0, idx].clone()
        _slice(model, site, idx, scale[site.conv])
    with torch.no_grad():  # scope "all": the extra gates become fixed BN scales
        fold_extra_gates(master, model, sample, min(sparsity, 1.0 - 1e-9))
    model.train(was_training)
    _match_format(model, master)
    return Surrogate(model=model, keep=float(keep), kept=kept, sites=master.sites,
                     scale=scale, origin=_origin(model, master.sites),
                     master_sparsity=sparsity)

"""Filter-grained update of a surrogate and write-back into the master (ElasticDNN §3).

1. `filter_scores`: one probe batch through the surrogate under SHOT's information-
   maximisation loss; a kept filter's score is |dL/dgamma| + |dL/dbeta| of its BN.
2. `select_filters`: the fewest filters (over all gated convs) holding `mass` (0.8) of the
   total score.
3. `mask_gradients`: only the selected filters train: their conv rows, BN gamma/beta and the
   next conv's input columns (a weight of a Bottleneck's conv2 trains when its row or its
   column belongs to a selected filter); every other parameter is frozen. Hooks zero the
   unselected gradient entries; an optimizer without weight decay (`filter_optimizer`) then
   leaves them bit-identical (SGD momentum and Adam moments of a zero gradient stay 0).
4. `write_back`: the surrogate's change since extraction (the folded BN change divided by
   the gate value it was folded with; channels whose gate was 0 keep the master's BN) goes
   into the master at the kept indices, by `MASTER_UPDATES`:
   - "knowledge" (the paper, §III-B3 Eqs. 3-4): per conv layer a surrogate changes, the
     change in the master's format is stored into Θ* (Eq. 3) and the layer's filters are
     rewritten from Θ* (Eq. 4), one layer at a time (tta_core.elasticdnn.knowledge); the
     tensors Θ* does not hold take the change (`master_bn` "change": BN affine and
     statistics, conv biases) or keep the master's BN affine and conv biases ("keep": only
     Θ*'s filters and the BN statistics move);
   - "averaging" (the authors' group's public code, not the paper): master += (surrogate -
     origin) / 2, every tensor;
   - "none": the master is not updated.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from tta_core.elasticdnn.gates import GatedModel
from tta_core.elasticdnn.knowledge import require_knowledge
from tta_core.elasticdnn.surrogate import Surrogate

MASTER_UPDATES = ("knowledge", "averaging", "none")
MASTER_BN = ("change", "keep")  # knowledge update: what BN affine / conv biases do


def im_loss(logits: Tensor) -> Tensor:
    """SHOT's information-maximisation loss: mean entropy of the predictions minus the
    entropy of their batch mean (confident and diverse); float32 at least, float64 kept
    (tta_core.runtime.losses.entropy_loss is float32 only)."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, K], got shape {tuple(logits.shape)}")
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), 1)
    p = logp.exp()
    mean = p.mean(0)
    return -(p * logp).sum(1).mean() + torch.special.xlogy(mean, mean).sum()


def _modules(surrogate: Surrogate) -> dict[str, nn.Module]:
    return dict(surrogate.model.named_modules())


def filter_scores(surrogate: Surrogate, batch: Tensor) -> dict[str, Tensor]:
    """Per gated conv, per kept filter: |dL/dgamma| + |dL/dbeta| of its BN on `batch`
    (L = im_loss, the model in train mode: batch statistics). Nothing of the surrogate
    changes (BN running statistics and .grad restored)."""
    model, mods = surrogate.model, _modules(surrogate)
    bns = [mods[s.bn] for s in surrogate.sites]
    params = [p for bn in bns for p in (bn.weight, bn.bias)]
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    was_training, flags = model.training, [p.requires_grad for p in params]
    try:
        model.train()
        for p in params:
            p.requires_grad_(True)
        grads = torch.autograd.grad(im_loss(model(batch)), params, allow_unused=True)
    finally:
        model.train(was_training)
        for p, f in zip(params, flags, strict=True):
            p.requires_grad_(f)
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
    zero = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]
    return {s.conv: (zero[2 * i].abs() + zero[2 * i + 1].abs()).detach()
            for i, s in enumerate(surrogate.sites)}


def select_filters(scores: dict[str, Tensor], mass: float = 0.8) -> dict[str, Tensor]:
    """Bool masks (like `scores`): the fewest filters, over all convs, whose scores sum to at
    least `mass` of the total (the highest scores; none when every score is 0)."""
    if not 0.0 < mass <= 1.0:
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    names = list(scores)
    flat = torch.cat([scores[n].reshape(-1).double() for n in names]) if names else \
        torch.zeros(0, dtype=torch.float64)
    if (flat < 0).any() or not torch.isfinite(flat).all():
        raise ValueError("filter scores must be finite and >= 0")
    chosen = torch.zeros(len(flat), dtype=torch.bool, device=flat.device)
    total = float(flat.sum())
    if total > 0:
        order = torch.argsort(flat, descending=True, stable=True)
        csum = torch.cumsum(flat[order], 0)
        n = int(torch.searchsorted(csum, flat.new_tensor(mass * total * (1 - 1e-12)))) + 1
        chosen[order[:min(n, len(flat))]] = True
    out, start = {}, 0
    for name in names:
        size = scores[name].numel()
        out[name] = chosen[start:start + size].reshape(scores[name].shape)
        start += size
    return out


def _param_masks(surrogate: Surrogate, masks: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per parameter name of the surrogate: which entries belong to a selected filter."""
    mods = _modules(surrogate)
    out: dict[str, Tensor] = {}

    def add(name: str, m: Tensor) -> None:
        out[name] = out[name] | m if name in out else m

    for s in surrogate.sites:
        sel = masks[s.conv].to(torch.bool)
        conv, nxt = mods[s.conv], mods[s.next_conv]
        add(f"{s.conv}.weight", sel.view(-1, 1, 1, 1).expand_as(conv.weight))
        if conv.bias is not None:
            add(f"{s.conv}.bias", sel)
        add(f"{s.bn}.weight", sel)
        add(f"{s.bn}.bias", sel)
        add(f"{s.next_conv}.weight", sel.view(1, -1, 1, 1).expand_as(nxt.weight))
    return {k: v.contiguous() for k, v in out.items()}


def mask_gradients(surrogate: Surrogate, masks: dict[str, Tensor]) -> list:
    """Freeze every parameter of the surrogate but the selected filters' slices (see the
    module doc); hooks zero the other entries' gradients. Returns the hook handles."""
    missing = [s.conv for s in surrogate.sites if s.conv not in masks]
    if missing:
        raise ValueError(f"masks lack gated convs {missing[:3]}")
    pmasks = _param_masks(surrogate, masks)
    handles = []
    for name, p in surrogate.model.named_parameters():
        p.requires_grad_(name in pmasks)
        if name in pmasks:
            m = pmasks[name]
            handles.append(p.register_hook(
                lambda g, m=m: torch.where(m, g, torch.zeros_like(g))))
    return handles


def filter_optimizer(surrogate: Surrogate, lr: float, momentum: float = 0.9
                     ) -> torch.optim.SGD:
    """SGD over the trainable (masked) parameters, without weight decay: decay would move
    the unselected entries the gradient masks keep fixed."""
    params = [p for p in surrogate.model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters: call mask_gradients first")
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=0.0)


def _master_index(surrogate: Surrogate) -> dict[str, tuple[Tensor | None, Tensor | None]]:
    """Per sliced tensor name: (kept rows, kept input columns) in the master's tensor."""
    rows: dict[str, Tensor] = {}
    cols: dict[str, Tensor] = {}
    for s in surrogate.sites:
        rows[s.conv] = rows[s.bn] = surrogate.kept[s.conv]
        cols[s.next_conv] = surrogate.kept[s.conv]
    out = {}
    for name in surrogate.origin:
        module, _, kind = name.rpartition(".")
        r = rows.get(module)
        c = cols.get(module) if kind == "weight" else None
        out[name] = (r, c)
    return out


def _deltas(master: GatedModel, surrogate: Surrogate
            ) -> Iterator[tuple[str, Tensor, Tensor | None, Tensor]]:
    """(name in the master's base, kept rows, kept columns or None, change) of every
    sliced tensor that changed, the folded BN change divided by its gate (module doc)."""
    current = dict(surrogate.model.named_parameters()) | dict(surrogate.model.named_buffers())
    scale = {s.bn: surrogate.scale[s.conv] for s in surrogate.sites}
    for name, (r, c) in _master_index(surrogate).items():
        delta = current[name].detach() - surrogate.origin[name]
        module, _, kind = name.rpartition(".")
        if module in scale and kind in ("weight", "bias"):  # folded gamma / beta
            g = scale[module].to(delta.dtype)
            delta = torch.where(g > 0, delta / torch.where(g > 0, g, 1), 0)
        if bool(delta.any()):
            yield name, r, c, delta


def check_master_update(mode: str) -> str:
    """`mode` if it is one of MASTER_UPDATES; ValueError naming it otherwise."""
    if mode not in MASTER_UPDATES:
        raise ValueError(f"master_update must be one of {', '.join(MASTER_UPDATES)}, got "
                         f"{mode!r}")
    return mode


@torch.no_grad()
def write_back(master: GatedModel, surrogate: Surrogate, mode: str = "averaging",
               master_bn: str = "change") -> None:
    """Update the master with the surrogate's change by `mode` (module doc); entries the
    surrogate did not hold stay bit-identical, except that Eq. 4 rewrites every filter of
    a knowledge layer the surrogate changed (each becomes w_i(j, :) Θ*_i)."""
    check_master_update(mode)
    if master_bn not in MASTER_BN:
        raise ValueError(f"master_bn must be one of {', '.join(MASTER_BN)}, got {master_bn!r}")
    if mode == "none":
        return
    kn = require_knowledge(master) if mode == "knowledge" else None
    params = dict(master.base.named_parameters())
    target = params | dict(master.base.named_buffers())
    for name, r, c, delta in _deltas(master, surrogate):
        dst = target[name]
        rr = r if r is not None else torch.arange(dst.shape[0])
        module = name.rpartition(".")[0]
        if kn is not None and name.endswith(".weight") and module in kn.layers:
            full = torch.zeros_like(dst)
            if c is None:
                full[rr] = delta.to(dst.dtype)
            else:
                full[rr[:, None], c[None, :]] = delta.to(dst.dtype)
            kn.store(module, full)  # Eq. 3
            del full
            kn.recall(module, dst)  # Eq. 4
            continue
        if kn is not None and master_bn == "keep" and name in params:
            continue  # BN affine, conv bias: outside Θ*, the master's kept
        step = delta if kn is not None else delta / 2
        if c is None:
            dst[rr] += step.to(dst.dtype)
        else:
            dst[rr[:, None], c[None, :]] += step.to(dst.dtype)

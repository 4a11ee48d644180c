"""SURGEON: memory-efficient TTA by dynamic activation sparsity (seed 003; official code
github.com/kadmkbl/SURGEON, methods/das.py).

Per batch, each trainable layer gets a keep ratio for what it saves for ∂W (Eqs. 4-7,
tta_core.surgeon.layer_importance); the adaptation forward runs under the activation codec
(tta_core.memory.codec): conv/linear inputs magnitude-pruned to the layer's keep ratio and
held as a 1-bit position bitmap (int32 indices below 1/32 kept) + kept values, BN/LN inputs
centred-pruned at the norm layer's own keep ratio (`prune_norm`: exact means + the largest
deviations; ∂γ and ∂x then approximate, as the paper's counts assume; the official code
counts them pruned but keeps a dense copy for ∂x), ReLU saves as exact 1-bit masks,
max-pool inputs not stored (exact), max-pool indices in int16.

mode "faithful" (Algorithm 1): an extra forward/backward of the entropy on k random samples
of the batch (default 1, as the paper's Table 5; official code: 10), each a random crop of
side `importance_crop` (default 0.5, crops >= CROP_MIN_SIDE px only), gives the gradients
of Eq. 4; it runs under the codec (ReLU masks, frozen inputs not stored; scored inputs,
BN inputs included, at `importance_keep`, default 0.01: §4.2 (ii)'s high static pruning),
and with `importance_bits` (default 8, DAF packing; None: dense) what it keeps whole is
stored per-group min-max quantized, so the scoring pass saves a small fraction of the
adaptation pass (docs/results/surgeon_peak.md; the official code runs it dense, above
Tent's peak). Eq. 5's sizes come from one no-grad forward per input shape.
mode "robot": no extra pass; Eq. 4 uses the gradients of the previous update (lagged).
They were computed under that update's pruning, which biases against pruned layers: a low
keep ratio shrinks their gradient norms (the classifier's most), a keep near 0.5 hardly.
The first step (and the first after set_units or a new input size) has no usable gradient
yet: it is dense.

Keep ratios are clamped to [keep_floor, 1] (default 0, as Eq. 7 and the official code:
keep_i = I_i / max I, 0 only for a layer of zero importance, which is then frozen for the
batch, its input not stored; see the README for the measured keeps). `bn_grad: official`
reproduces the official code's BN backward (running statistics from before the forward;
tta_core.surgeon.bn_official) in both passes. `units` restricts the update (and the keep
ratios) to named units; the others are frozen. Eager PyTorch saves a conv/linear input
even when the weight is frozen (no ∂W is computed, ∂x needs only the weight): frozen
units' inputs are stored at FROZEN_KEEP (≈ the 1-bit bitmap alone), which changes no gradient.

`activation_bits` (8/4/2; DAF's uniform widths, tta_core.memory.widths): what SURGEON
leaves dense is quantized too: BN inputs and the inputs of scored layers kept whole (keep
1) are stored per-group min-max quantized at that width, frozen layers' inputs are not
stored at all (0 bits); pruned layers keep their bitmap + values. `activation_budget_mb` /
`activation_budget_frac` (not with `activation_bits`): DAF's dynamic widths
(runtime.capabilities, the shared loop) store the adaptation forward's saves instead of the
pruning: 0/2/4/8 bits per trainable unit per batch under the budget; a unit given keep 0 by
Eqs. 4-7 stays frozen for the batch (0 bits), the importance pass is unchanged.

Loss: entropy (default); `css` adds certainty-based sample selection (entropy < 0.4 ln C,
weights exp(0.4 ln C - H), as EATA/MECTA and the official code) and `cr` consistency
regularisation, 0.01 · C · CE(softmax(logits), logits of an augmented copy) (official code;
the augmented copy here: CoTTA's cheap augmentation, tta_core.runtime.augment, without
its shift for segmentation logits, N x C x H x W, whose pixels it would misalign; entropy,
CSS and CR are then per pixel). Adam,
biases frozen (official). Default lr: the official CIFAR-10-C rates (batch 200) mapped
onto tta's convention (rate at batch 64, scaled by batch/64): 1e-3 (BN only) -> 3.2e-4,
2.2e-5 (all layers) -> 7.04e-6; at batch 200 a step runs with exactly the official rate.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from tta_core.api import StepResult
from tta_core.memory import DENSE, ActivationCodec, CodecPlan, SavedBytes
from tta_core.memory.scope import unit_table
from tta_core.memory.widths import check_activation_bits, daf_plan
from tta_core.model.norms import NORM_NAMES, NORM_TYPES, set_bn_mode
from tta_core.registry import register
from tta_core.runtime.augment import cheap_augment
from tta_core.runtime.capabilities import MemoryOptions, StepCodec, build_codec
from tta_core.runtime.losses import is_dense, softmax_entropy
from tta_core.runtime.method import MethodConfig, Step, TTAMethod
from tta_core.runtime.options import option
from tta_core.surgeon.bn_official import official_bn_grad
from tta_core.surgeon.layer_importance import LayerImportance, gradient_importances, layer_keep

MODES = ("faithful", "robot")
BN_GRADS = ("exact", "official")
TRAINABLE = ("all", "norm")
OFFICIAL_LR = {"norm": 1e-3, "all": 2.2e-5}  # Adam, CIFAR-10-C, batch 200 (official cfgs)
OFFICIAL_BATCH = 200
_PRUNABLE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)  # the codec prunes their inputs
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)  # centred pruning (prune_norm)
_NUMERIC = ("lr", "keep_floor", "importance_samples", "importance_keep", "importance_crop",
            "css_margin", "cr_weight", "max_shift")
# importance crops at least this side: a 32x-downsampling net (ImageNet ResNets) then keeps
# >= 2x2 positions per channel at its last norm layer, as batch statistics of one sample need
CROP_MIN_SIDE = 64
FROZEN_KEEP = 1e-6  # frozen conv/linear inputs: ~bitmap only (1/32 of float32), never read


@dataclass
class SurgeonConfig(MethodConfig, MemoryOptions):
    """SURGEON settings; lr None = the official rate for `trainable` (see module doc);
    DAF's dynamic widths from MemoryOptions' budgets (module doc)."""

    lr: float | None = option(  # type: ignore[assignment]
        None, "Adam learning rate at batch size lr_ref_batch; None: the official rate for "
        "`trainable` (module doc)", low=0.0)
    mode: str = option("faithful", "faithful: an extra importance pass per batch; robot: "
                       "the previous update's (lagged) gradients", choices=MODES)
    trainable: str = option("all", "all: every weight (SURGEON); norm: BN/LN/GN affine "
                            "parameters (SURGEON (BN))", choices=TRAINABLE)
    keep_floor: float = option(0.0, "lowest keep ratio of a layer's saved input (Eq. 7 "
                               "gives 0 to the least important layer: frozen for the "
                               "batch); in [0, 1]", low=0.0, high=1.0)
    importance_samples: int = option(1, "faithful mode: samples of the importance pass "
                                     "(paper Table 5: 1; official code: 10)", low=1)
    # paper §4.2 (ii): high static pruning; ReLU masks and frozen inputs compressed anyway
    importance_keep: float = option(0.01, "faithful mode: keep ratio of the scored layers' "
                                    "inputs in the importance pass (1.0 with "
                                    "importance_bits None and importance_crop 1: exact "
                                    "gradients); in (0, 1]", low=0.0, high=1.0)
    importance_crop: float = option(0.5, "faithful mode: side of the random crop of each "
                                    "importance sample, as a fraction of the image's "
                                    "(1: whole image; only crops >= 64 px a side; README "
                                    "deviations); in (0, 1]",
                                    low=0.0, high=1.0)
    importance_bits: int | None = option(
        8, "faithful mode: store the importance pass's unpruned saves (BN inputs included) "
        "at 8, 4 or 2 bits (DAF); None: dense", choices=(2, 4, 8))
    bn_grad: str = option("exact", "BN backward: exact (batch statistics) or official (the "
                          "official code's, with the running statistics from before the "
                          "forward)", choices=BN_GRADS)
    css: bool = option(False, "certainty-based sample selection")
    css_margin: float = option(0.4, "css: a sample is selected when its entropy < css_margin "
                               "* ln C (> 0)", low=0.0)
    cr: bool = option(False, "consistency regularisation (one augmented forward more)")
    cr_weight: float = option(0.01, "cr: loss weight, times the class count C (official "
                              "code)", low=0.0)
    units: tuple[str, ...] = option((), "update only these units (module names); () = all")
    biases: bool = option(False, "update biases too (the official code never does)")
    act_masks: bool = option(True, "ReLU saves as exact 1-bit masks")
    reforward: bool = option(True, "predict with the updated model (as tent here)")
    max_shift: int = option(2, "cr: augmentation shift, px", low=0)
    seed: int = option(0, "seed of the importance subset and the cr augmentation")
    prune_norm: bool = option(True, "store BN/LN inputs centred-pruned at the layer's keep "
                              "ratio (False: dense, exact ∂γ and ∂x; module doc)")
    activation_bits: int | None = option(None, "DAF: store what is not pruned at 8, 4 or 2 "
                                         "bits (None: dense; module doc)", choices=(2, 4, 8))

    def check(self) -> None:
        """Raise a one-line ValueError naming the first bad value (`units` given as a
        string, as `tta bench --set surgeon.units=fc,layer3.0.conv1` does, is split at
        commas)."""
        if isinstance(self.units, str):
            self.units = tuple(u.strip() for u in self.units.split(",") if u.strip())
        for name in _NUMERIC:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real | None):
                raise ValueError(f"{name} must be a number, got {value!r}")
        checks = (
            (self.mode in MODES, f"mode must be one of {MODES}, got {self.mode!r}"),
            (self.trainable in TRAINABLE,
             f"trainable must be one of {TRAINABLE}, got {self.trainable!r}"),
            (0 <= self.keep_floor <= 1, f"keep_floor must be in [0, 1], got {self.keep_floor}"),
            (self.bn_grad in BN_GRADS,
             f"bn_grad must be one of {BN_GRADS}, got {self.bn_grad!r}"),
            (self.importance_samples >= 1,
             f"importance_samples must be >= 1, got {self.importance_samples}"),
            (0 < self.importance_keep <= 1,
             f"importance_keep must be in (0, 1], got {self.importance_keep}"),
            (0 < self.importance_crop <= 1,
             f"importance_crop must be in (0, 1], got {self.importance_crop}"),
            (self.css_margin > 0, f"css_margin must be > 0, got {self.css_margin}"),
            (self.cr_weight >= 0, f"cr_weight must be >= 0, got {self.cr_weight}"),
            (self.lr is None or self.lr >= 0, f"lr must be >= 0, got {self.lr}"),
            (self.max_shift >= 0, f"max_shift must be >= 0, got {self.max_shift}"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for bits in (self.activation_bits, self.importance_bits):
            if bits is not None:
                check_activation_bits(bits)


def default_lr(trainable: str, ref_batch: int) -> float:
    """The official Adam rate (batch 200) as a rate at `ref_batch` (0: unscaled)."""
    lr = OFFICIAL_LR[trainable]
    return lr * ref_batch / OFFICIAL_BATCH if ref_batch else lr


def consistency(logits: Tensor, logits_aug: Tensor) -> Tensor:
    """CE of the augmented prediction against the clean one (gradient through both)."""
    return -(logits.softmax(1) * logits_aug.log_softmax(1)).sum(1).mean()


def surgeon_loss(logits: Tensor, logits_aug: Tensor | None, cfg: SurgeonConfig
                 ) -> tuple[Tensor, int]:
    """(loss, samples used): entropy, CSS-weighted when cfg.css, + CR when logits_aug."""
    ent = softmax_entropy(logits)
    used = logits.shape[0]
    if cfg.css:
        margin = cfg.css_margin * math.log(logits.shape[1])
        sel = ent.detach() < margin
        used = int(sel.sum())
        weight = torch.exp(margin - ent.detach())
        loss = (ent * weight)[sel].mean() if used else ent.sum() * 0.0
    else:
        loss = ent.mean()
    if logits_aug is not None:
        loss = loss + cfg.cr_weight * logits.shape[1] * consistency(logits, logits_aug)
    return loss, used


def _candidates(mod: nn.Module, cfg: SurgeonConfig) -> list[nn.Parameter]:
    """The parameters of unit `mod` that `trainable` and `biases` allow to update."""
    if cfg.trainable == "norm" and not isinstance(mod, NORM_TYPES):
        return []
    return [p for pn, p in mod.named_parameters(recurse=False)
            if cfg.biases or not pn.endswith("bias")]



def fused_ok(params: list[nn.Parameter]) -> bool:
    """Whether Adam's fused kernel takes `params` (floating point, CPU or CUDA): it keeps the
    step counts on the device, where the other implementations read each one back to the
    host per parameter and step."""
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                                for p in params)

@register("surgeon")
class Surgeon(TTAMethod):
    """Dynamic activation sparsity: per-layer keep ratios from gradient x memory importance."""

    config_cls = SurgeonConfig
    config: SurgeonConfig

    def __init__(self, model: nn.Module, config: SurgeonConfig | None = None) -> None:
        super().__init__(model, config)
        self.gen = torch.Generator().manual_seed(self.config.seed)
        self._sizes: dict[tuple[int, ...], dict[str, int]] = {}  # per sample shape
        self._lagged: dict[str, float] | None = None  # robot: G_i of the last update
        self.last_keep: dict[str, float] = {}
        self.last_importance: LayerImportance | None = None
        self._zero: list[nn.Parameter] = []

    # ------------------------------------------------------------ setup
    def configure_model(self) -> None:
        cfg = self.config
        cfg.check()
        if cfg.lr is None:
            cfg.lr = default_lr(cfg.trainable, cfg.lr_ref_batch)
        if cfg.bn_grad == "official":  # batch statistics; running ones kept and updated
            if cfg.bn_mode != "batch":
                raise ValueError(f"bn_grad 'official' needs bn_mode 'batch', got "
                                 f"{cfg.bn_mode!r}")
            self.model.eval()
            for m in self.model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.train()
        else:
            set_bn_mode(self.model, cfg.bn_mode)
        self.model.requires_grad_(False)
        rows = unit_table(self.model)[1]
        self.unit_names = [name for name, _m, _k in rows]
        self._unit_mods = {name: mod for name, mod, _k in rows}
        self._cand = {n: ps for n, m, _k in rows if (ps := _candidates(m, cfg))}
        if not self._cand:
            lacks = (f"no {NORM_NAMES} layer with affine parameters" if cfg.trainable == "norm"
                     else "no parameters")
            raise self.nothing_to_adapt(lacks)
        self.set_units(cfg.units)

    def make_codec(self) -> StepCodec | None:
        """DAF's dynamic widths under `activation_budget_mb` / `_frac` (module doc); without
        a budget SURGEON plans its own codec per batch (None here)."""
        cfg = self.config
        if cfg.activation_budget_mb is None and cfg.activation_budget_frac is None:
            if cfg.activation_arena:
                raise ValueError("surgeon: activation_arena needs activation_budget_mb or "
                                 "activation_budget_frac, got neither")
            return None
        if cfg.activation_bits is not None:
            raise ValueError("surgeon: a budget (dynamic widths) takes no activation_bits, "
                             f"got activation_bits={cfg.activation_bits!r}")
        return build_codec(self.model, cfg)

    def set_units(self, units: tuple[str, ...] | list[str]) -> None:
        """Update (and give keep ratios to) only these units from the next step; () = all."""
        unknown = sorted(set(units) - set(self._cand))
        if unknown:
            raise ValueError(f"surgeon: unit(s) {unknown[:5]} not in the model's units with "
                             f"trainable parameters (trainable={self.config.trainable!r})")
        self.config.units = tuple(units)
        self.scored = [n for n in self._cand if not units or n in units]
        for name, params in self._cand.items():
            for p in params:
                p.requires_grad_(name in self.scored)
        self._lagged = None

    def collect_params(self) -> list[nn.Parameter]:
        """Every candidate parameter (set_units toggles requires_grad; Adam skips no-grad)."""
        return [p for params in self._cand.values() for p in params]

    def setup_optimizer(self) -> torch.optim.Optimizer:
        """Adam, as the official configs (beta1 = config.momentum, 0.9)."""
        return torch.optim.Adam(self.params, lr=self.config.lr,
                                betas=(self.config.momentum, 0.999), weight_decay=0.0,
                                fused=fused_ok(self.params))

    # ------------------------------------------------------------ importance
    @contextmanager
    def _size_hooks(self, x: Tensor) -> Iterator[None]:
        """Record per-sample input element counts of every unit (Eq. 5's m_i) during the
        forward in the context, once per sample shape."""
        key = tuple(x.shape[1:])
        if key in self._sizes:
            yield
            return
        sizes = dict.fromkeys(self.unit_names, 0)

        def hook(name: str) -> Callable[[nn.Module, tuple], None]:
            def pre(_m: nn.Module, args: tuple) -> None:
                if args and isinstance(args[0], Tensor) and args[0].shape[0]:
                    sizes[name] += args[0].numel() // args[0].shape[0]
            return pre

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in self._unit_mods.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()
        self._sizes[key] = sizes

    def _gradient_importance(self, grads: dict[int, Tensor | None]) -> dict[str, float]:
        """Eq. 4 per scored unit that ran; a parameter without gradient counts as zeros."""
        return gradient_importances({
            name: [g if (g := grads.get(id(p))) is not None else torch.zeros_like(p)
                   for p in self._cand[name]] for name in self.scored})

    def _keep(self, gradient: dict[str, float], x: Tensor) -> LayerImportance:
        sizes = self._sizes[tuple(x.shape[1:])]
        ran = {k: v for k, v in gradient.items() if sizes.get(k, 0) > 0}
        return layer_keep(ran, sizes, self.config.keep_floor)

    def _importance_pass(self, x: Tensor) -> tuple[LayerImportance, int, int]:
        """Faithful mode: (Eqs. 4-7 on k random samples (random crops of them), k, bytes the
        pass saved)."""
        self._record_sizes(x)
        k = min(max(self.config.importance_samples, self._fewest_samples(x)), int(x.shape[0]))
        idx = torch.randperm(int(x.shape[0]), generator=self.gen)[:k].to(x.device)
        sub = self._crop(x[idx])
        params = [p for n in self.scored for p in self._cand[n]]
        keep = self.config.importance_keep
        codec = ActivationCodec(self.model, self._plan({n: keep for n in self.scored},
                                                       self.config.importance_bits))
        with torch.enable_grad(), codec, self._bn_grad():
            loss = softmax_entropy(self.model(sub)).mean()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        by_param = {id(p): g for p, g in zip(params, grads, strict=True)}
        imp = self._keep(self._gradient_importance(by_param), x)
        return imp, k, codec.result.total if codec.result else 0

    def _fewest_samples(self, x: Tensor) -> int:
        """2 where a BatchNorm unit sees one position per sample at x's shape (a 1x1 map:
        batch statistics need more than one value per channel), else 1."""
        sizes = self._sizes[tuple(x.shape[1:])]
        single = any(isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
                     and 0 < sizes.get(n, 0) <= m.num_features
                     for n, m in self._unit_mods.items())
        return 2 if single else 1

    def _crop(self, sub: Tensor) -> Tensor:
        """A random crop of side `importance_crop` of the images (N, C, H, W) when it keeps
        at least CROP_MIN_SIDE px a side; else `sub`."""
        frac = self.config.importance_crop
        if frac >= 1 or sub.dim() != 4:
            return sub
        h, w = (max(1, round(frac * d)) for d in sub.shape[2:])
        if min(h, w) < CROP_MIN_SIDE:
            return sub
        top, left = (int(torch.randint(int(d) - c + 1, (1,), generator=self.gen))
                     for d, c in zip(sub.shape[2:], (h, w), strict=True))
        return sub[:, :, top:top + h, left:left + w]

    def _record_sizes(self, x: Tensor) -> None:
        """Eq. 5's m_i at x's sample shape, once per shape: a no-grad forward of x with the
        norm layers' running statistics restored after it."""
        if tuple(x.shape[1:]) in self._sizes:
            return
        state = {n: b.clone() for n, b in self.model.named_buffers()}
        with torch.no_grad(), self._size_hooks(x):
            self.model(x)
        with torch.no_grad():
            for n, b in self.model.named_buffers():
                b.copy_(state[n])

    def _bn_grad(self) -> AbstractContextManager[None]:
        """The official BN backward around a forward when `bn_grad` asks for it."""
        return official_bn_grad(self.model, self.config.bn_grad == "official")

    def _plan(self, scored: dict[str, float] | None, bits: int | None) -> CodecPlan:
        """`scored` keep ratios for the scored units (keep 0: the unit is frozen for the
        batch): conv/linear inputs pruned, BN/LN inputs centred-pruned (`prune_norm`);
        frozen conv/linear units FROZEN_KEEP (autograd saves their input although no ∂W is
        computed: nothing reads it, ∂x needs only the weight) or 0 bits with DAF `bits`,
        norm units frozen for the batch FROZEN_KEEP (means only); max-pool inputs not
        stored; everything else dense or at `bits`."""
        if scored is None:  # no ratios yet: scored units dense
            scored = dict.fromkeys(self.scored, 1.0)
        live = {n: v for n, v in scored.items() if v > 0}
        keep: dict[str, float | str] = {
            n: FROZEN_KEEP for n, m in self._unit_mods.items()
            if isinstance(m, _PRUNABLE) and n not in live}
        keep.update({n: v for n, v in live.items()
                     if isinstance(self._unit_mods[n], _PRUNABLE) and v < 1.0})
        norm = {}
        if self.config.prune_norm:
            norm = {n: (v if v > 0 else FROZEN_KEEP) for n, v in scored.items()
                    if isinstance(self._unit_mods[n], _NORMS) and v < 1.0}
        if bits is not None:  # DAF: frozen inputs dropped, unpruned inputs and BN quantized
            pruned = {n: v for n, v in keep.items() if n in live and v < 1.0}
            return daf_plan(self.model, bits, keep=pruned, act_masks=self.config.act_masks,
                            norm_keep=norm, pool_inputs=True)
        return CodecPlan(keep, DENSE, act_masks=self.config.act_masks, narrow_ints=True,
                         norm_keep=norm, pool_inputs=True)

    # ------------------------------------------------------------ step
    def _adapt_forward(self, x: Tensor, plan: CodecPlan
                       ) -> tuple[Tensor, Tensor, int, SavedBytes | None]:
        """Forward (+ augmented forward for CR) and loss under the codec (DAF's dynamic
        widths when a budget is set, else the batch's plan)."""
        codec = self.codec if self.codec is not None else ActivationCodec(self.model, plan)
        with torch.enable_grad(), self._size_hooks(x), codec, self._bn_grad():
            logits = self.model(x)
            aug = None
            if self.config.cr:  # no shift for per-pixel logits: it would misalign them
                shift = 0 if is_dense(logits) else self.config.max_shift
                aug = self.model(cheap_augment(x, self.gen, shift))
            loss, used = surgeon_loss(logits, aug, self.config)
        return logits, loss, used, codec.result

    def prepare(self, step: Step) -> None:
        """The keep ratios of this batch: an importance pass (faithful) or the previous
        step's gradients (robot), and the codec plan they give."""
        imp, self._k, self._imp_bytes = None, 0, 0
        if self.config.mode == "faithful":
            imp, self._k, self._imp_bytes = self._importance_pass(step.x)
        elif self._lagged is not None and tuple(step.x.shape[1:]) in self._sizes:
            imp = self._keep(self._lagged, step.x)
        self.last_importance = imp
        keep = imp.keep if imp is not None else None
        self._zero = [p for n, v in (keep or {}).items() if v <= 0
                      for p in self._cand[n] if p.requires_grad]
        for p in self._zero:  # keep 0 (Eq. 7): no ∂W this batch; plan them as frozen
            p.requires_grad_(False)
        self._codec_plan = self._plan(keep, self.config.activation_bits)

    def forward(self, step: Step) -> None:
        try:
            step.logits, step.loss, self._used, self._saved = self._adapt_forward(
                step.x, self._codec_plan)
        finally:  # the recorded graph keeps them frozen for this batch
            for p in self._zero:
                p.requires_grad_(True)
            self._zero = []

    def update(self, step: Step) -> None:
        """Backward and step when a sample is used (or CR is on); robot mode keeps this
        step's gradient importance for the next batch."""
        if not (self._used > 0 or self.config.cr):
            return
        self.optimizer.zero_grad(set_to_none=True)
        step.loss.backward()
        if self.codec is not None:  # DAF's widths: importance from this step's gradients
            self.codec.after_backward(self.model)
        if self.config.mode == "robot":  # a unit frozen by keep 0 keeps its last G
            fresh = self._gradient_importance(
                {id(p): p.grad for n in self.scored for p in self._cand[n]})
            ran = {n for n in self.scored if any(p.grad is not None for p in self._cand[n])}
            self._lagged = {n: g if n in ran or self._lagged is None
                            else self._lagged.get(n, g) for n, g in fresh.items()}
        self.optimizer.step()
        step.adapted = True

    def units_updated(self, step: Step) -> int:
        return len(self.scored) if step.adapted else 0

    def step_result(self, step: Step) -> StepResult:
        imp = self.last_importance
        self.last_keep = dict(imp.keep) if imp is not None else dict.fromkeys(self.scored, 1.0)
        res = super().step_result(step)
        res.importance = self._importance_vector(imp)
        res.stats.update(self._stats(self._saved, self._imp_bytes, self._k, self._used,
                                     imp is not None))
        return res

    def _importance_vector(self, imp: LayerImportance | None) -> np.ndarray:
        """I_i per unit of `unit_names` (0 for frozen units); empty without importance."""
        if imp is None:
            return np.zeros(0)
        return np.array([imp.importance.get(n, 0.0) for n in self.unit_names])

    def _stats(self, saved: SavedBytes | None, imp_bytes: int, k: int, used: int,
               pruned: bool) -> dict[str, float | int | bool]:
        keep = list(self.last_keep.values()) or [1.0]
        saved = saved if saved is not None else SavedBytes(0, {}, {}, 0, 0, 0, 0)
        total = saved.total
        return {
            "saved_bytes": total, "saved_mib": total / 2**20,
            "importance_saved_bytes": imp_bytes,
            "peak_saved_bytes": max(total, imp_bytes),
            "peak_saved_mib": max(total, imp_bytes) / 2**20,
            "analytic_bytes": saved.analytic, "analytic_kept_bytes": saved.analytic_kept,
            "keep_min": min(keep), "keep_mean": float(np.mean(keep)), "keep_max": max(keep),
            "importance_samples": k, "n_used": used, "pruned": pruned,
        }

    def reset_state(self) -> None:
        self.gen.manual_seed(self.config.seed)
        self._lagged = None
        self.last_keep = {}
        self.last_importance = None

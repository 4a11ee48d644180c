"""SAR: sharpness-aware and reliable entropy minimisation.

Niu et al., "Towards Stable Test-Time Adaptation in Dynamic Wild World", ICLR 2023.
- reliable samples only: entropy < E0 = 0.4·ln C (filtered again after the SAM ascent);
- SAM (rho = 0.05): gradient at the worst-case point w + rho·g/||g|| updates w;
- model recovery: when the EMA (0.9) of the second-step loss drops below 0.2 the model
  has collapsed to trivial confident predictions, so weights and optimizer are reset;
- updates the affine parameters of norm layers (BN/GN/LN), skipping the top blocks as in
  the reference code (ResNet layer4, ViT blocks 9–11 and the final norm) — our 3-stage
  small_resnet has no such block, so all its BN layers adapt.
Segmentation (N x C x H x W logits): every pixel is a sample, as the entropy maps of
`softmax_entropy` give them (SAR has no segmentation variant of its own): the reliable
filter (both SAM passes) is per pixel, each loss the mean entropy of the reliable pixels,
and the recovery EMA runs on that per-pixel loss.
The prediction is the pre-update forward's, as the paper's code (`reforward=True`:
AdaShadow's forward-backward-reforward). The SAM base optimizer and its settings by input
scale unless set (`_presets`):

| input scale | optimizer | lr | lr scaling | source |
|---|---|---|---|---|
| cifar (<= 64 px) | SGD m 0.9 | 1e-3 | none | mariodoebler/test-time-adaptation cfgs/cifar10_c/sar.yaml (its SAR steps SGD) |
| imagenet | SGD m 0.9 | 2.5e-4 | lr·min(b/32, 1) | SAR §5 (ResNet, batch 64); mr-eggplant/SAR main.py: 2.5e-4·b/64·2 below batch 32 |
"""  # noqa: E501

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from tta_core.methods._presets import Preset, PresetConfig, PresetMethod
from tta_core.registry import register
from tta_core.runtime.capabilities import MemoryOptions
from tta_core.runtime.losses import softmax_entropy
from tta_core.runtime.method import Step
from tta_core.runtime.options import option

SAR_PRESETS = {
    "cifar": Preset("sgd", 1e-3, source="test-time-adaptation cfgs/cifar10_c/sar.yaml"),
    "imagenet": Preset("sgd", 2.5e-4, 32, lr_cap=True,
                       source="SAR §5; mr-eggplant/SAR main.py"),
}


@dataclass
class SARConfig(PresetConfig, MemoryOptions):
    """SAR settings (paper defaults); DAF saves from MemoryOptions (both SAM forwards)."""

    e_margin_scale: float = option(0.4, "reliable samples: entropy below E0 = "
                                   "e_margin_scale * ln(C)", low=0.0)
    rho: float = option(0.05, "SAM neighbourhood radius", low=0.0)
    reset_constant: float = option(0.2, "model recovery when the EMA of the loss drops "
                                   "below this", low=0.0)
    ema_momentum: float = option(0.9, "momentum of that loss EMA", low=0.0, high=1.0)
    # reference code: timm and torchvision spellings of ResNet layer4, ViT-B blocks 9-11
    skip: tuple[str, ...] = option(
        ("layer4", "blocks.9.", "blocks.10.", "blocks.11.", "encoder_layer_9.",
         "encoder_layer_10.", "encoder_layer_11."),
        "module-name fragments whose norm layers are not adapted")
    skip_exact: tuple[str, ...] = option(("norm", "encoder.ln", "fc_norm"), "module names "
                                         "whose norm layers are not adapted (final norms)")
    reforward: bool = option(False, "forward-backward-reforward (AdaShadow §2.2): predict "
                             "with the updated model; False: the pre-update prediction "
                             "(the paper)")


@register("sar")
class SAR(PresetMethod):
    """Reliable-sample SAM entropy minimisation with collapse recovery."""

    config_cls = SARConfig
    presets: ClassVar[dict[str, Preset]] = SAR_PRESETS
    config: SARConfig

    def __init__(self, model: nn.Module, config: SARConfig | None = None) -> None:
        self.ema: float | None = None
        self.recoveries = 0
        super().__init__(model, config)

    def _adapted(self, name: str) -> bool:
        c = self.config
        return name not in c.skip_exact and not any(s in name + "." for s in c.skip)

    def configure_model(self) -> None:
        super().configure_model()
        self.train_norm_affine(include=self._adapted)

    def e_margin(self, num_classes: int) -> float:
        """E0 = 0.4 · ln C."""
        return self.config.e_margin_scale * math.log(num_classes)

    def _sam_update(self, x: Tensor, loss1: Tensor, keep: Tensor, e0: float) -> float:
        """Ascend to w + e(w), take the gradient there, restore w, step. Returns loss 2."""
        # allow_unused: a unit DAF's widths froze for the batch (0 bits) has no gradient
        grads = torch.autograd.grad(loss1, self.params, allow_unused=True)
        norm = torch.norm(torch.stack([g.norm(2) for g in grads if g is not None]), 2)
        scale = self.config.rho / (norm + 1e-12)
        old = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for p, g in zip(self.params, grads, strict=True):
                if g is not None:
                    p.add_(g * scale)
        with torch.enable_grad():
            with self.recording():  # the second forward's saves under the codec too
                logits2 = self.model(x)
            ent2 = softmax_entropy(logits2)[keep]
            ent2 = ent2[ent2 < e0]  # reliable again at the perturbed weights
            loss2 = ent2.mean() if ent2.numel() else None
            grads2 = (torch.autograd.grad(loss2, self.params, allow_unused=True)
                      if loss2 is not None else [torch.zeros_like(p) for p in self.params])
        with torch.no_grad():
            for p, o, g, g1 in zip(self.params, old, grads2, grads, strict=True):
                p.copy_(o)
                p.grad = g if g1 is not None else None
        if self.codec is not None:
            self.codec.after_backward(self.model)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss2.detach()) if loss2 is not None else math.nan

    def loss(self, logits: Tensor) -> Tensor | None:
        """Entropy of the reliable samples (pixels of N x C x H x W logits) (entropy <
        E0); None when there are none."""
        self._e0 = self.e_margin(logits.shape[1])
        ent = softmax_entropy(logits)
        self._keep = ent.detach() < self._e0
        return ent[self._keep].mean() if bool(self._keep.any()) else None

    def update(self, step: Step) -> None:
        """The SAM update on the reliable samples; a collapse of the loss EMA resets the
        model to the source."""
        recovered = False
        if step.loss is not None:
            step.loss_value = self._sam_update(step.x, step.loss, self._keep, self._e0)
            step.adapted = True
            if not math.isnan(step.loss_value):
                m = self.config.ema_momentum
                self.ema = (step.loss_value if self.ema is None
                            else m * self.ema + (1 - m) * step.loss_value)
            if self.ema is not None and self.ema < self.config.reset_constant:
                self.reset()  # collapse: back to the source model
                self.recoveries += 1
                recovered = True
        step.stats.update(n_reliable=int(self._keep.sum()), recovered=recovered,
                          loss_ema=self.ema if self.ema is not None else math.nan)

    def reset_state(self) -> None:
        self.ema = None

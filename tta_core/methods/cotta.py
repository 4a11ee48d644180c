"""CoTTA: continual test-time adaptation with a mean teacher.

Wang et al., "Continual Test-Time Domain Adaptation", CVPR 2022.
- the prediction is the EMA teacher's (momentum 0.999);
- when the source (anchor) model's mean confidence on the batch is below 0.92 (the
  paper's CIFAR-10 threshold) the teacher's prediction is averaged over augmented copies;
- the student (all parameters) minimises cross-entropy to the teacher's soft labels;
- stochastic restore: each weight returns to its source value with p = 0.01 per step.
The reference code uses 32 augmentations (colour jitter, affine, blur, flip, noise); for
small images on a CPU we use a few cheap, label-preserving ones (contrast/brightness
jitter, shifts of ≤ 2 px, light noise — no flips: traffic-sign arrows are chiral).
Segmentation (N x C x H x W logits; the reference code's ACDC setting, qinenergy/cotta
acdc/mmseg/apis/test.py single_gpu_cotta): the teacher's augmented prediction is the mean
softmax over scales (`seg_scales`, each resized back to H x W) and horizontal flips, the
flip inverted on the output, so every copy stays aligned with the mask (no shift: a
geometric change left uninverted would misalign it); per pixel, where the anchor's
confidence exceeds `anchor_threshold` the teacher's single-scale prediction is kept, else
the augmented one; the student learns cross-entropy to its argmax (hard pseudo-labels,
per pixel). The reference averages 7 scales (0.5-2.0) x 2 flips; the default here is 3
scales x 2 (CPU cost); its settings for ACDC (Adam 6e-5/8 at batch 1, restore 0.01,
threshold 0.69) are what `tta bench --task segmentation` runs CoTTA with (eval.seg_bench).
Settings by input scale unless set (`_presets`; the teacher's momentum is 0.999 at both):

| input scale | optimizer | lr | lr scaling | other settings | source |
|---|---|---|---|---|---|
| cifar (<= 64 px) | Adam (0.9, 0.999) | 1e-3 | none | restore_prob 0.01, anchor_threshold 0.92 | CoTTA §4 (CIFAR10-C); qinenergy/cotta cifar/cfgs/cifar10/cotta.yaml |
| imagenet | SGD m 0.9 nesterov | 0.01 | none | restore_prob 0.001, anchor_threshold 0.1 | CoTTA §4 (ImageNet-C, batch 64); qinenergy/cotta imagenet cfgs and cotta.py |
"""  # noqa: E501

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tta_core.methods._presets import Preset, PresetConfig, PresetMethod
from tta_core.model.norms import set_bn_mode
from tta_core.registry import register
from tta_core.runtime.augment import cheap_augment
from tta_core.runtime.capabilities import MemoryOptions
from tta_core.runtime.losses import is_dense
from tta_core.runtime.method import Step
from tta_core.runtime.options import option

COTTA_PRESETS = {
    "cifar": Preset("adam", 1e-3, fields=(("restore_prob", 0.01), ("anchor_threshold", 0.92)),
                    source="CoTTA §4; qinenergy/cotta cifar/cfgs/cifar10/cotta.yaml"),
    "imagenet": Preset("sgd", 0.01, nesterov=True,
                       fields=(("restore_prob", 0.001), ("anchor_threshold", 0.1)),
                       source="CoTTA §4; qinenergy/cotta imagenet/cotta.py"),
}


@dataclass
class CoTTAConfig(PresetConfig, MemoryOptions):
    """CoTTA settings (the paper's by input scale; n_augmentations reduced from 32); DAF
    saves of the student's forward from MemoryOptions."""

    teacher_momentum: float = option(0.999, "EMA momentum of the mean teacher", low=0.0,
                                     high=1.0)
    anchor_threshold: float | None = option(None, "average the teacher over augmented copies "
                                            "when the source model's mean confidence is "
                                            "below this; None: the preset's", low=0.0,
                                            high=1.0)
    restore_prob: float | None = option(None, "stochastic restore: probability per weight and "
                                        "step of returning to its source value; None: the "
                                        "preset's", low=0.0, high=1.0)
    n_augmentations: int = option(4, "augmented copies the teacher averages over (the "
                                  "reference code: 32)", low=0)
    max_shift: int = option(2, "augmentation shift, px", low=0)
    seed: int = option(0, "seed of the augmentations and the stochastic restore")
    seg_scales: tuple[float, ...] = option((0.75, 1.0, 1.25), "segmentation: the scales the "
                                           "teacher averages over (reference: 0.5-2.0 in "
                                           "steps of 0.25)")
    seg_flip: bool = option(True, "segmentation: average horizontal flips too (inverted on "
                            "the output)")


@torch.no_grad()
def scale_flip_probs(model: nn.Module, x: Tensor, scales: tuple[float, ...],
                     flip: bool) -> Tensor:
    """Mean softmax of `model` over x resized by each scale (outputs resized back to x's
    H x W) and, with `flip`, their mirror images (flipped back): aligned with x's pixels."""
    h, w = x.shape[2:]
    total, n = None, 0
    for s in scales:
        xs = x if s == 1 else F.interpolate(x, scale_factor=float(s), mode="bilinear",
                                             align_corners=False)
        for mirrored in ((False, True) if flip else (False,)):
            out = model(xs.flip(3) if mirrored else xs)
            out = out.flip(3) if mirrored else out
            if out.shape[2:] != (h, w):
                out = F.interpolate(out, size=(h, w), mode="bilinear", align_corners=False)
            p = out.softmax(1)
            total, n = (p if total is None else total + p), n + 1
    if total is None:
        raise ValueError("cotta: seg_scales is empty")
    return total / n


@register("cotta")
class CoTTA(PresetMethod):
    """Mean-teacher self-training on every parameter, with stochastic restore."""

    config_cls = CoTTAConfig
    presets: ClassVar[dict[str, Preset]] = COTTA_PRESETS
    config: CoTTAConfig
    teacher: nn.Module
    anchor: nn.Module

    def configure_model(self) -> None:
        if self.config.n_augmentations < 0:
            raise ValueError(f"n_augmentations must be >= 0, got {self.config.n_augmentations}")
        if not any(True for _ in self.model.parameters()):
            raise self.nothing_to_adapt("no parameters")
        set_bn_mode(self.model, self.config.bn_mode)
        self.model.requires_grad_(True)
        self.teacher = copy.deepcopy(self.model).requires_grad_(False)
        self.anchor = copy.deepcopy(self.model).requires_grad_(False)
        self._source = [p.detach().clone() for p in self.model.parameters()]
        self.gen = torch.Generator().manual_seed(self.config.seed)

    @torch.no_grad()
    def _teacher_prediction(self, x: Tensor) -> tuple[Tensor, bool]:
        """Teacher logits, augmentation-averaged when the anchor is unsure."""
        anchor_conf = self.anchor(x).softmax(1).max(1).values.mean()
        out = self.teacher(x)
        augmented = bool(anchor_conf < self.config.anchor_threshold)
        if augmented and self.config.n_augmentations > 0:
            outs = [self.teacher(cheap_augment(x, self.gen, self.config.max_shift))
                    for _ in range(self.config.n_augmentations)]
            out = torch.stack(outs).mean(0)
        return out, augmented

    @torch.no_grad()
    def _update_teacher_and_restore(self) -> None:
        m = self.config.teacher_momentum
        for pt, ps in zip(self.teacher.parameters(), self.model.parameters(), strict=True):
            pt.mul_(m).add_(ps.detach(), alpha=1 - m)
        if self.config.restore_prob <= 0:
            return
        for p, src in zip(self.model.parameters(), self._source, strict=True):
            mask = torch.rand(p.shape, generator=self.gen).to(p.device) < self.config.restore_prob
            p.copy_(torch.where(mask, src, p))

    @torch.no_grad()
    def _teacher_segmentation(self, x: Tensor) -> tuple[Tensor, float]:
        """Per-pixel teacher prediction (module doc) as log-probabilities, and the share of
        pixels that took the augmented one."""
        unsure = self.anchor(x).softmax(1).amax(1) <= self.config.anchor_threshold
        single = self.teacher(x).softmax(1)
        if bool(unsure.any()):
            aug = scale_flip_probs(self.teacher, x, tuple(self.config.seg_scales),
                                   self.config.seg_flip)
            single = torch.where(unsure.unsqueeze(1), aug, single)
        return single.clamp_min(1e-12).log(), float(unsure.float().mean())

    def forward(self, step: Step) -> None:
        """Student forward, the teacher's (augmentation-averaged) prediction, and the CIFAR
        variant of the reference loss: cross-entropy to the teacher's softmax; per pixel
        to its argmax for segmentation logits (the ACDC code)."""
        with torch.enable_grad(), self.recording():  # the student's saves: DAF widths
            step.logits = self.model(step.x)
        if is_dense(step.logits):
            self._teacher, step.stats["augmented"] = self._teacher_segmentation(step.x)
            with torch.enable_grad():
                step.loss = F.cross_entropy(step.logits, self._teacher.argmax(1))
            return
        self._teacher, step.stats["augmented"] = self._teacher_prediction(step.x)
        with torch.enable_grad():
            step.loss = -(self._teacher.softmax(1) * step.logits.log_softmax(1)).sum(1).mean()

    def update(self, step: Step) -> None:
        super().update(step)
        self._update_teacher_and_restore()

    def predict(self, step: Step) -> None:
        step.out = self._teacher  # the teacher's prediction, as the reference

    def units_updated(self, step: Step) -> int:
        return sum(1 for m in self.model.modules()
                   if any(True for _ in m.parameters(recurse=False)))

    def reset_state(self) -> None:
        self.teacher.load_state_dict(self._model_state)
        self.gen.manual_seed(self.config.seed)

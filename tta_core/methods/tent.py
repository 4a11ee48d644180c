"""Tent: test entropy minimisation over the affine parameters of the norm layers.

Wang et al., "Tent: Fully Test-Time Adaptation by Entropy Minimization", ICLR 2021.
Adapts the weight/bias of BatchNorm, LayerNorm and GroupNorm layers, as the peer code does
(DequanWang/tent, mariodoebler/test-time-adaptation), so LayerNorm-only models (ViT) adapt
too. One forward and one backward per batch: the prediction is the pre-update forward's
(the paper's method, §3, and its code); `reforward=True` is the forward-backward-reforward step of
AdaShadow's paper (§2.2, sequential mode), whose prediction is a second forward of the
updated model. The optimizer and its settings are the paper's (§4, "Optimization") unless
set, by input scale (`_presets`):

| input scale | optimizer | lr | lr scaling | source |
|---|---|---|---|---|
| cifar (<= 64 px) | Adam (0.9, 0.999) | 1e-3 | none | Tent §4; DequanWang/tent cfgs/tent.yaml; mariodoebler/test-time-adaptation cfgs/cifar10_c/tent.yaml |
| imagenet | SGD m 0.9 nesterov | 2.5e-4 | lr·b/64 | Tent §4 (batch 64); cfgs/imagenet_c/tent.yaml of the latter; nesterov: both codes' SGD |

With `activation_bits` / `activation_budget_mb` / `activation_budget_frac` the forward
stores its saves through DAF's codec (runtime.capabilities.MemoryOptions); `trainable: all`
adapts every parameter instead of the norm layers' (conv/linear inputs then get DAF widths). The forwards take config.precision (autocast;
the entropy on fp32 logits, BN statistics and optimizer state fp32); they run eagerly (no
CUDA graphs: the recorded forward feeds a backward, the reforward follows an update).
"""  # noqa: E501

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tta_core.methods._presets import Preset, PresetConfig, PresetMethod
from tta_core.registry import register
from tta_core.runtime.capabilities import MemoryOptions
from tta_core.runtime.method import Step
from tta_core.runtime.options import option
from tta_core.runtime.precision import PRECISIONS

TRAINABLE = ("norm", "all")
TENT_PRESETS = {
    "cifar": Preset("adam", 1e-3, source="Tent §4; DequanWang/tent cfgs/tent.yaml"),
    "imagenet": Preset("sgd", 2.5e-4, 64, nesterov=True,
                       source="Tent §4; test-time-adaptation cfgs/imagenet_c/tent.yaml"),
}


@dataclass
class TentConfig(PresetConfig, MemoryOptions):
    """Tent settings; the prediction is the pre-update forward's unless `reforward`."""

    reforward: bool = option(False, "forward-backward-reforward (AdaShadow §2.2): predict "
                             "with a second forward of the updated model; False: the "
                             "pre-update logits (the Tent paper)")
    trainable: str = option("norm", "norm: the norm layers' affine parameters (Tent); all: "
                            "every parameter (conv/linear inputs then get DAF widths too)",
                            choices=TRAINABLE)


@register("tent")
class Tent(PresetMethod):
    """Entropy minimisation on norm-layer weight/bias; BN uses batch statistics."""

    config_cls = TentConfig
    precisions = PRECISIONS
    presets: ClassVar[dict[str, Preset]] = TENT_PRESETS

    def configure_model(self) -> None:
        super().configure_model()
        trainable = getattr(self.config, "trainable", "norm")  # EATA: norm layers only
        if trainable not in TRAINABLE:
            raise ValueError(f"{self.name}: trainable must be one of {TRAINABLE}, got "
                             f"{trainable!r}")
        if trainable == "norm":
            self.train_norm_affine()
        elif not any(True for _ in self.model.parameters()):
            raise self.nothing_to_adapt("no parameters")
        else:
            self.model.requires_grad_(True)

    def units_updated(self, step: Step) -> int:
        """Norm layers updated (`trainable: norm`) or modules with a parameter updated."""
        if not step.adapted or getattr(self.config, "trainable", "norm") == "norm":
            return super().units_updated(step)
        ids = {id(p) for p in self.params}
        return sum(1 for m in self.model.modules()
                   if any(id(p) in ids for p in m.parameters(recurse=False)))

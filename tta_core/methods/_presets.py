"""Published optimizer settings of the gradient baselines, chosen by the input's scale.

Each baseline that steps an optimizer (tent, eata, sar, cotta) runs at its paper's and its
reference code's settings unless the user sets them: one `Preset` per input scale,
CIFAR-scale (inputs of at most `CIFAR_MAX_PX` px a side) and ImageNet-scale (larger).
`PresetConfig` declares the settings a preset fills (`optimizer`, `lr`, `lr_ref_batch`,
`momentum`, and a method's own fields such as CoTTA's `restore_prob`) with None ("the
preset's") as the default; a value the user gives is kept. The scale comes from
`input_shape` (filled from the model card), else `scale`; with neither, the first batch's
size decides and the optimizer is rebuilt before its first step (it holds no state yet).
The tables of settings and their sources are the methods' own (`presets` of each class).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from tta_core.api import Plan, StepResult
from tta_core.runtime.method import MethodConfig, TTAMethod
from tta_core.runtime.options import option

SCALES = ("auto", "cifar", "imagenet")
OPTIMIZERS = ("adam", "sgd")
CIFAR_MAX_PX = 64  # the largest side of a CIFAR-scale input (CIFAR 32 px, Tiny-ImageNet 64)
PRESET_FIELDS = ("optimizer", "lr", "lr_ref_batch", "momentum")


@dataclass(frozen=True)
class Preset:
    """One method's published optimizer settings at one input scale.

    `lr` is the rate at batch `lr_ref_batch` (0: at every batch); `lr_cap` caps the linear
    scaling at 1 (SAR's code: lr * min(b / ref, 1)); `nesterov` is the SGD flag of the
    reference code; `fields` fills method-specific options; `source` cites the setting."""

    optimizer: str
    lr: float
    lr_ref_batch: int = 0
    momentum: float = 0.9
    nesterov: bool = False
    lr_cap: bool = False
    fields: tuple[tuple[str, Any], ...] = ()
    source: str = ""

    def values(self) -> dict[str, Any]:
        """The option values this preset fills (PRESET_FIELDS and `fields`)."""
        return {"optimizer": self.optimizer, "lr": self.lr, "lr_ref_batch": self.lr_ref_batch,
                "momentum": self.momentum, **dict(self.fields)}


@dataclass
class PresetConfig(MethodConfig):
    """MethodConfig whose optimizer settings default to the method's published preset."""

    scale: str = option("auto", "input scale whose published settings fill the options left "
                        "unset: cifar (<= 64 px a side), imagenet, or auto (from input_shape, "
                        "else the first batch)", choices=SCALES, runtime=False)
    optimizer: str | None = option(None, "adam or sgd; None: the preset's", choices=OPTIMIZERS,
                                   runtime=False)
    lr: float | None = option(None, "learning rate at batch size lr_ref_batch (each step runs "
                              "at lr * batch / lr_ref_batch); None: the preset's", low=0.0)
    lr_ref_batch: int | None = option(None, "batch size lr is meant at (linear scaling); 0: lr "
                                      "as given at every batch size; None: the preset's",
                                      low=0)
    momentum: float | None = option(None, "SGD momentum; None: the preset's", low=0.0)


def input_scale(input_shape: tuple[int, ...]) -> str | None:
    """'cifar' for a (C, H, W) of at most CIFAR_MAX_PX a side, 'imagenet' above, None for
    an unknown shape (not (C, H, W))."""
    if len(input_shape) != 3:
        return None
    return "cifar" if max(input_shape[1:]) <= CIFAR_MAX_PX else "imagenet"


def preset_table(presets: dict[str, Preset]) -> str:
    """Markdown rows (scale, optimizer, lr, scaling, other settings, source) of `presets`."""
    rows = ["| input scale | optimizer | lr | lr scaling | other settings | source |",
            "|---|---|---|---|---|---|"]
    for scale, p in presets.items():
        opt = "Adam (0.9, 0.999)" if p.optimizer == "adam" else (
            f"SGD m {p.momentum:g}" + (" nesterov" if p.nesterov else ""))
        scaling = ("none" if not p.lr_ref_batch else
                   f"lr·min(b/{p.lr_ref_batch}, 1)" if p.lr_cap else f"lr·b/{p.lr_ref_batch}")
        other = ", ".join(f"{k} {v:g}" for k, v in p.fields) or "-"
        rows.append(f"| {scale} | {opt} | {p.lr:g} | {scaling} | {other} | {p.source} |")
    return "\n".join(rows)


class PresetMethod(TTAMethod):
    """A TTAMethod whose optimizer and its settings come from `presets` (module doc)."""

    presets: ClassVar[dict[str, Preset]] = {}
    config: PresetConfig

    def setup_optimizer(self) -> torch.optim.Optimizer | None:
        """Adam or SGD at the resolved settings (None when there is nothing to adapt)."""
        if not hasattr(self, "preset"):
            self._resolve(self._known_scale() or "cifar")
        if not self.params:
            return None
        c = self.config
        if c.optimizer == "adam":  # fused: the step count stays a tensor (no host read)
            fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda")
                        for p in self.params)
            return torch.optim.Adam(self.params, lr=c.lr, betas=(0.9, 0.999), fused=fused)
        nesterov = self.preset.nesterov and c.momentum > 0
        return torch.optim.SGD(self.params, lr=c.lr, momentum=c.momentum, nesterov=nesterov)

    def _known_scale(self) -> str | None:
        if self.config.scale not in SCALES:
            raise ValueError(f"{self.name}: scale={self.config.scale!r} not one of "
                             f"{', '.join(SCALES)}")
        if self.config.scale != "auto":
            return self.config.scale
        return input_scale(tuple(self.config.input_shape))

    def _resolve(self, scale: str) -> None:
        """Fill the options left unset (or filled by an earlier resolve) from the preset."""
        self.preset, self.resolved_scale = self.presets[scale], scale
        filled: set[str] = getattr(self, "_filled", set())
        for key, value in self.preset.values().items():
            if getattr(self.config, key) is None or key in filled:
                setattr(self.config, key, value)
                filled.add(key)
        self._filled = filled
        if self.config.optimizer not in OPTIMIZERS:
            raise ValueError(f"{self.name}: optimizer={self.config.optimizer!r} not one of "
                             f"{', '.join(OPTIMIZERS)}")
        self._scale_pending = self._known_scale() is None

    def _step(self, x: Tensor, plan: Plan | None) -> StepResult:
        if getattr(self, "_scale_pending", False) and x.ndim == 4:
            self._scale_pending = False
            scale = input_scale(tuple(x.shape[1:]))
            if scale is not None and scale != self.resolved_scale:
                self._resolve(scale)
                self.optimizer = self.setup_optimizer()
                self._opt_state = (copy.deepcopy(self.optimizer.state_dict())
                                   if self.optimizer is not None else None)
                self._lr_batch = None
        return super()._step(x, plan)

    def set_lr(self, lr: float) -> None:
        """Change the learning rate (at lr_ref_batch); a preset no longer fills it."""
        super().set_lr(lr)
        self._filled.discard("lr")

    def effective_lr(self, batch: int) -> float | None:
        """lr * batch / lr_ref_batch (capped at lr where the preset caps it: SAR), lr itself
        when lr_ref_batch is 0; None when the method has no optimizer."""
        if self.optimizer is None:
            return None
        ref, lr = self.config.lr_ref_batch, self.config.lr
        if not ref:
            return lr
        factor = batch / ref
        if self.preset.lr_cap and "lr_ref_batch" in self._filled:
            factor = min(factor, 1.0)
        return lr * factor

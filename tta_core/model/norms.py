"""Normalisation layers: BatchNorm statistics modes and the affine parameters that
norm-based TTA methods (Tent, EATA, SAR, CoTTA's BN mode, AdaShadow's 'norm') adapt."""

from __future__ import annotations

import re
from collections.abc import Callable

from torch import nn

BN_MODES = ("batch", "source", "robust")
#: methods that keep BN running statistics moving with the test stream (bn_mode "robust")
ROBUST_BN_METHODS = ("adashadow",)
#: layers whose affine weight/bias norm-based methods adapt (the peers' choice)
NORM_TYPES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm,
                                            nn.GroupNorm)
#: NORM_TYPES as people name them, for messages
NORM_NAMES = "BatchNorm/LayerNorm/GroupNorm"
AFFINE = ("weight", "bias")


def norm_counts(model: nn.Module) -> dict[str, int]:
    """How many normalisation layers of each class `model` has ("LayerNorm2d": 18), in
    module order: every class whose name ends in Norm or Norm1d/2d/3d (BatchNorm2d,
    LayerNorm, GroupNorm, ...; not Conv2dNormActivation, a block holding one)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        name = type(m).__name__
        if re.search(r"Norm(\dd)?$", name):
            counts[name] = counts.get(name, 0) + 1
    return counts


def require_batchnorm(model: nn.Module, method: str) -> None:
    """Nothing when `model` has a BatchNorm layer; else ValueError, one line: "<method>
    needs BatchNorm layers; ConvNeXt has none (its norms: LayerNorm2d x18, LayerNorm x1)"."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return
    norms = ", ".join(f"{k} \N{MULTIPLICATION SIGN}{n}" for k, n in norm_counts(model).items())
    raise ValueError(f"{method} needs BatchNorm layers; {type(model).__name__} has none "
                     f"({f'its norms: {norms}' if norms else 'no normalisation layers'})")


def set_bn_mode(model: nn.Module, bn_mode: str) -> None:
    """eval() everywhere; with "batch", BN layers normalise by batch statistics only.
    "robust" is eval mode too: the method moves the running statistics toward each
    batch's before BN normalises (RoTTA's robust BN, tta_core.model.robust_bn.RobustBN); only
    ROBUST_BN_METHODS do, so the others refuse it (TTAMethod.configure_model)."""
    if bn_mode not in BN_MODES:
        raise ValueError(f"bn_mode {bn_mode!r} not in {BN_MODES}")
    model.eval()
    if bn_mode == "batch":
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()
                m.track_running_stats = False
                m.running_mean = None
                m.running_var = None


def norm_affine_params(model: nn.Module, include: Callable[[str], bool] | None = None
                       ) -> list[nn.Parameter]:
    """Affine weight/bias of every NORM_TYPES layer, in module order, as DequanWang/tent
    and mariodoebler/test-time-adaptation collect them. `include(module_name)` False drops
    a layer (SAR's skipped top blocks). Layers built without affine params add nothing."""
    return [p for name, m in model.named_modules()
            if isinstance(m, NORM_TYPES) and (include is None or include(name))
            for pn, p in m.named_parameters(recurse=False) if pn in AFFINE]

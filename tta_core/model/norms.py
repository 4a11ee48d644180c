"""Normalisation layers: BatchNorm statistics modes and the affine parameters that
norm-based TTA methods (Tent, EATA, SAR, CoTTA's BN mode, AdaShadow's 'norm') adapt."""

from __future__ import annotations

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

"""The architecture a model card names, built with random weights (the card's checkpoint
fills them in): three routes, none of which downloads anything.

- a tta zoo arch (`small_resnet`, ...: tta_core.model.zoo);
- any torchvision classification model by name (`resnet18`, `efficientnet_b0`, ...), built
  with `weights=None, num_classes=N` plus the card's kwargs;
- a factory `package.module:function` (or `:Class`) from the user's own code, called with
  the card's kwargs exactly, e.g. a CIFAR-style ResNet whose stem differs from ImageNet's.

A factory runs code from the Python path when a card is loaded, like an import: cards
are trusted as much as the code they name. Standard-library, torch, numpy and tta's own
entry points are refused as factories, and only Python functions or classes are called
(no builtins), so a card cannot turn a stock function into a command.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections.abc import Callable
from functools import cache
from typing import Any

from torch import nn
from torchvision import models as tvm

from tta_core.errors import InputError, one_line
from tta_core.model.zoo import ARCHS, SEG_ARCHS, SmallResNet, build_model

FACTORY_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
# top-level packages a card may not name as its factory (besides the standard library)
REFUSED_PACKAGES = frozenset({"torch", "torchvision", "numpy", "pip", "setuptools",
                              "pkg_resources", "tta_ros", "rclpy"})
# tta's own factories: the zoo (tta_core.model.zoo:SmallResNet), ElasticDNN's gated master
ALLOWED_TTA_CORE = ("tta_core.model.", "tta_core.elasticdnn.card")
# factories that moved: cards written before keep loading
MOVED_FACTORIES = {"tta_core.model.gated:gated_master": "tta_core.elasticdnn.card:gated_master"}
# kwargs the torchvision route sets itself: never downloaded weights, the card's classes
RESERVED_KWARGS = ("weights", "num_classes", "pretrained")


@cache
def torchvision_archs() -> tuple[str, ...]:
    """Names of torchvision's classification models (torchvision.models.list_models)."""
    return tuple(tvm.list_models(module=tvm))


def is_factory(model: str) -> bool:
    """Whether `model` names a factory ('package.module:function') rather than an arch."""
    return ":" in model


def check_arch(arch: str, factory: str = "", kwargs: dict | None = None) -> None:
    """ValueError naming `arch`/`factory` when the card could not build it (no import)."""
    if factory:
        if not FACTORY_PATTERN.match(factory):
            raise ValueError(f"factory {factory!r} is not 'package.module:function'")
        if not arch.strip():
            raise ValueError(f"arch is empty (factory {factory!r}: name the architecture)")
        return
    if arch not in ARCHS and arch not in SEG_ARCHS and arch not in torchvision_archs():
        raise ValueError(f"arch {arch!r} is neither a tta arch ({', '.join(ARCHS)}) nor a "
                         "torchvision classification model (e.g. resnet18, efficientnet_b0); "
                         "for your own code give a factory 'package.module:function'")
    reserved = sorted(set(kwargs or {}) & set(RESERVED_KWARGS))
    if reserved:
        raise ValueError(f"kwargs {reserved} are set by tta for arch {arch!r} (random init, "
                         "the card's num_classes; weights come from the checkpoint)")


def load_factory(factory: str) -> Callable[..., Any]:
    """The function or class `factory` names, imported; ValueError/InputError saying why
    it cannot be used."""
    factory = MOVED_FACTORIES.get(factory, factory)
    check_arch("factory", factory)
    module, _, attr = factory.partition(":")
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top in REFUSED_PACKAGES or (
            top == "tta_core" and not module.startswith(ALLOWED_TTA_CORE)):
        raise ValueError(f"factory {factory!r}: {module!r} is not a model package (a "
                         "factory is a function or class of your own code that builds the "
                         "model; torchvision models are named by arch, e.g. resnet18)")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise InputError(f"factory {factory!r}: cannot import {module!r} ({one_line(exc)}); "
                         "is its package installed or on PYTHONPATH?") from None
    fn = getattr(mod, attr, None)
    if fn is None:
        raise InputError(f"factory {factory!r}: module {module!r} has no {attr!r}")
    if not (inspect.isfunction(fn) or inspect.isclass(fn)):
        raise InputError(f"factory {factory!r} is a {type(fn).__name__}, not a Python "
                         "function or class")
    return fn


def factory_kwargs(factory: str, num_classes: int, kwargs: dict | None = None) -> dict:
    """The kwargs a card records for `factory`: `kwargs`, plus num_classes when the factory
    takes a `num_classes` argument and `kwargs` does not set it."""
    out = dict(kwargs or {})
    try:
        params = inspect.signature(load_factory(factory)).parameters
    except (TypeError, ValueError):  # no signature: pass kwargs as given
        return out
    if "num_classes" in params and "num_classes" not in out:
        out["num_classes"] = num_classes
    return out


def build_architecture(arch: str, num_classes: int, factory: str = "",
                       kwargs: dict | None = None) -> nn.Module:
    """The model `arch` (or `factory(**kwargs)`) with random weights."""
    kwargs = dict(kwargs or {})
    check_arch(arch, factory, kwargs)
    if factory:
        fn = load_factory(factory)
        try:
            model = fn(**kwargs)
        except TypeError as exc:
            raise InputError(f"factory {factory!r} rejected kwargs {kwargs}: "
                             f"{one_line(exc)}") from None
        if not isinstance(model, nn.Module):
            raise InputError(f"factory {factory!r} returned a {type(model).__name__}, not a "
                             "torch nn.Module")
        return model
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if (arch in ARCHS or arch in SEG_ARCHS) and not kwargs:
        return build_model(arch, num_classes)
    try:
        if arch == "small_resnet":
            return SmallResNet(num_classes=num_classes, **kwargs)
        return tvm.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
    except TypeError as exc:
        raise InputError(f"arch {arch!r} rejected kwargs {kwargs}: {one_line(exc)}") from None

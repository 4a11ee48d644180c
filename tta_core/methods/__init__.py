"""Registry of test-time adaptation methods, one small module per method.

Modules in this package register their class with `@register("name")`; the package
imports every module on first lookup, so adding a method never edits a shared list.
Interface modelled on mariodoebler/test-time-adaptation (see `base.TTAMethod`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from torch import nn

_REGISTRY: dict[str, type] = {}
_loaded = False


def register(name: str) -> Callable[[type], type]:
    """Class decorator: make `cls` buildable as `build_method(name, ...)`."""
    def deco(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method name {name!r} already registered")
        _REGISTRY[name] = cls
        cls.name = name
        return cls
    return deco


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")
    _loaded = True


def available_methods() -> list[str]:
    """Sorted names of every registered method."""
    _load_all()
    return sorted(_REGISTRY)


def method_class(name: str) -> type:
    """The class registered as `name`; ValueError listing the choices otherwise."""
    _load_all()
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
    return _REGISTRY[name]


def build_method(name: str, model: nn.Module, **cfg):
    """Build method `name` on `model`; keyword arguments fill the method's config."""
    cls = method_class(name)
    return cls(model, cls.make_config(**cfg))

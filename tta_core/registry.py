"""Registry of test-time adaptation methods: the baselines in `tta_core.methods` and the
method class of each paper room (`tta_core.<room>.method`).

Method modules register their class with `@register("name")`; the registry imports them
by name on first lookup (importlib, so this module sits below every method in the import
layers and adding a baseline never edits a shared list). Interface modelled on
mariodoebler/test-time-adaptation (see `tta_core.runtime.method.TTAMethod`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import Any

# the paper rooms that define a method class in their `method` module
PAPER_ROOMS = ("adashadow", "surgeon", "darda", "elasticdnn")

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


def method_modules() -> list[str]:
    """Dotted names of every module that registers a method."""
    baselines = importlib.import_module("tta_core.methods")
    names = [f"tta_core.methods.{info.name}" for info in pkgutil.iter_modules(baselines.__path__)
             if not info.name.startswith("_")]
    return names + [f"tta_core.{room}.method" for room in PAPER_ROOMS]


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for module in method_modules():
        importlib.import_module(module)
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


def build_method(name: str, model: Any, **cfg: Any) -> Any:
    """Build method `name` on `model` (an nn.Module); keyword arguments fill its config."""
    cls = method_class(name)
    return cls(model, cls.make_config(**cfg))

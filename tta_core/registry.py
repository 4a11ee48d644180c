"""Registry of test-time adaptation methods: the baselines in `tta_core.methods` and the
method of each paper room (`tta_core.<room>.method`).

Method modules register their class with `@register("name")`; a method whose class
depends on its config registers a factory with `@register_factory("name", cls)` (`cls`:
the class whose config and documentation stand for the method). The registry imports
the method modules by name on first lookup (importlib, so this module sits below every
method in the import layers, imports none of them, and adding a baseline never edits a
shared list). Interface modelled on mariodoebler/test-time-adaptation (see
`tta_core.runtime.method.TTAMethod`).
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable
from typing import Any

# the package of the baselines (each module of it registers one) and the paper rooms that
# define a method in their `method` module
BASELINES = "tta_core.methods"
PAPER_ROOMS = ("adashadow", "surgeon", "darda", "elasticdnn")

_REGISTRY: dict[str, type] = {}
_FACTORIES: dict[str, Callable[..., Any]] = {}
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


def register_factory(name: str, cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Function decorator: `build_method(name, ...)` calls `factory(model, config)` (which
    chooses the class from the config) instead of `cls`; `cls` is what `method_class(name)`
    answers: its `config_cls` is the method's config, its docstring the method's."""
    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        register(name)(cls)
        _FACTORIES[name] = factory
        return factory
    return deco


def method_modules() -> list[str]:
    """Dotted names of every module that registers a method (found without importing
    the baselines' package)."""
    spec = importlib.util.find_spec(BASELINES)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"no package {BASELINES}")
    names = [f"{BASELINES}.{info.name}"
             for info in pkgutil.iter_modules(spec.submodule_search_locations)
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
    """The class registered as `name` (for a factory, the class that stands for the
    method); ValueError listing the choices otherwise."""
    _load_all()
    if name not in _REGISTRY:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
    return _REGISTRY[name]


def build_method(name: str, model: Any, **cfg: Any) -> Any:
    """Build method `name` on `model` (an nn.Module); keyword arguments fill its config."""
    cls = method_class(name)
    return _FACTORIES.get(name, cls)(model, cls.make_config(**cfg))

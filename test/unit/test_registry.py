"""The method registry: modules found by name, classes and factories, the darda factory."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT
from torch import nn

from tta_core import registry
from tta_core.darda.method import Darda, DardaConfig, PaperDarda, build_darda


def test_every_method_module_is_found_by_name() -> None:
    modules = registry.method_modules()
    assert "tta_core.methods.tent" in modules and "tta_core.darda.method" in modules
    assert not any(m.endswith("__init__") or m.split(".")[-1].startswith("_") for m in modules)
    assert {"source", "tent", "adashadow", "surgeon", "darda", "elastic"} <= set(
        registry.available_methods())


def test_the_baselines_package_does_not_load_the_registry() -> None:
    """Importing tta_core.methods imports nothing else of tta_core: no circle with the
    registry, which imports the baseline modules by name."""
    code = ("import sys, tta_core.methods; "
            "print(sorted(m for m in sys.modules if m.startswith('tta_core.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "['tta_core.methods']", out


def test_darda_is_a_factory_with_darda_as_its_class() -> None:
    assert registry.method_class("darda") is Darda
    assert Darda.name == PaperDarda.name == "darda"
    assert registry.method_class("darda").config_cls is DardaConfig


def test_build_method_calls_the_registered_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def factory(model: nn.Module, config: DardaConfig) -> str:
        calls.append(config.bundle_path)
        return "built"

    monkeypatch.setitem(registry._FACTORIES, "darda", factory)
    assert registry.build_method("darda", nn.Linear(2, 2), bundle_path="b.safetensors") == "built"
    assert calls == ["b.safetensors"]


def test_build_darda_chooses_the_class_from_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bundle_path selects the paper's online phase, none the online-learnt bank (the
    classes' construction itself is tested in test_darda.py / test_darda_paper.py)."""
    built = []
    monkeypatch.setattr(Darda, "__init__", lambda self, m, c: built.append(type(self)))
    monkeypatch.setattr(PaperDarda, "__init__", lambda self, m, c: built.append(type(self)))
    build_darda(nn.Linear(2, 2), DardaConfig(bundle_path="x.safetensors"))
    build_darda(nn.Linear(2, 2), DardaConfig())
    build_darda(nn.Linear(2, 2))
    assert built == [PaperDarda, Darda, Darda]


def test_a_name_registered_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        registry.register("tent")(type("Other", (), {}))
    with pytest.raises(ValueError, match="unknown method"):
        registry.method_class("no_such_method")

"""Norm-based baselines beyond BatchNorm: Tent, EATA, SAR (and CoTTA, which trains every
parameter) adapt LayerNorm and GroupNorm models, refuse a model with nothing to adapt in
one line at construction, and time their phases with the shared `api.PhaseClock`."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from tta_core.api import PhaseClock
from tta_core.model.norms import norm_affine_params
from tta_core.registry import build_method

SHAPE = (3, 16, 16)
CLASSES = 16
NORM_METHODS = ["tent", "eata", "sar"]
# Random weights predict near-uniformly (entropy close to ln C), which EATA's and SAR's
# reliability filter (entropy < e_margin_scale * ln C, 0.4 by default) would reject, and
# a near-uniform moving average makes every later sample "redundant" for EATA (cos ~ 1).
# With e_margin_scale > 1 every entropy (<= ln C) passes, with d_margin > 1 every cosine
# (<= 1): these tests are about *which* parameters adapt, not about the filters (those
# are tested in test_baselines.py). The high loss also keeps SAR's recovery (EMA < 0.2)
# from resetting the model. lr 0.1 unscaled makes the steps visible in float32.
OPTS: dict[str, dict] = {
    "eata": {"e_margin_scale": 1.01, "d_margin": 1.01},
    "sar": {"e_margin_scale": 1.01},
    "cotta": {"n_augmentations": 1},
}


def options(name: str, reforward: bool = False) -> dict:
    """Config of method `name` for these tests (see OPTS); `reforward` for Tent/EATA/SAR."""
    opts = {"lr": 0.1, "lr_ref_batch": 0, **OPTS.get(name, {})}
    if name in NORM_METHODS:
        opts["reforward"] = reforward
    return opts


class TinyNet(nn.Module):
    """conv -> map_norm -> ReLU -> 2x2 pool -> flatten -> feat_norm -> linear, random
    weights; the norms are Identity unless a subclass sets them."""

    def __init__(self, map_norm: nn.Module | None = None, feat_norm: nn.Module | None = None,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.map_norm = map_norm or nn.Identity()
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.feat_norm = feat_norm or nn.Identity()
        self.fc = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.map_norm(self.conv(x)))).flatten(1)
        return self.fc(self.feat_norm(h))


class LayerNormNet(TinyNet):
    """LayerNorm over the 32 features, as in a ViT (no BatchNorm anywhere)."""

    def __init__(self, affine: bool = True) -> None:
        super().__init__(feat_norm=nn.LayerNorm(32, elementwise_affine=affine))


class GroupNormNet(TinyNet):
    """GroupNorm (4 groups) over the conv maps."""

    def __init__(self) -> None:
        super().__init__(map_norm=nn.GroupNorm(4, 8))


class NoNormNet(TinyNet):
    """No normalisation layer at all."""


class Parameterless(nn.Module):
    """Class scores from the input itself: no parameter anywhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)[:, :CLASSES]


def batch(n: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randn((n, *SHAPE), generator=torch.Generator().manual_seed(seed))


def changed(before: dict[str, torch.Tensor], model: nn.Module) -> set[str]:
    return {k for k, v in model.named_parameters() if not torch.equal(v.detach(), before[k])}


NORM_MODELS = [(LayerNormNet, {"feat_norm.weight", "feat_norm.bias"}),
               (GroupNormNet, {"map_norm.weight", "map_norm.bias"})]


@pytest.mark.parametrize(("model_cls", "norm_params"), NORM_MODELS)
@pytest.mark.parametrize("name", [*NORM_METHODS, "cotta"])
def test_methods_adapt_layer_and_group_norm(name: str, model_cls: type[nn.Module],
                                            norm_params: set[str]) -> None:
    model = model_cls()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    meth = build_method(name, model, **options(name))
    for i in range(3):
        res = meth.step(batch(seed=i))
        assert res.adapted and torch.isfinite(res.logits).all()
    diff = changed(before, model)
    assert norm_params <= diff, f"{name} left {norm_params - diff} unchanged"
    if name == "cotta":  # trains every parameter (reference behaviour)
        assert {"conv.weight", "fc.weight"} <= diff
    else:
        assert diff == norm_params  # the affine norm params and nothing else


def test_norm_affine_params_filters_by_module_name() -> None:
    model = TinyNet(map_norm=nn.GroupNorm(4, 8), feat_norm=nn.LayerNorm(32))
    ids = [id(p) for p in norm_affine_params(model)]
    assert ids == [id(model.map_norm.weight), id(model.map_norm.bias),
                   id(model.feat_norm.weight), id(model.feat_norm.bias)]
    kept = norm_affine_params(model, include=lambda n: n != "map_norm")
    assert [id(p) for p in kept] == ids[2:]
    assert norm_affine_params(NoNormNet()) == []
    assert norm_affine_params(LayerNormNet(affine=False)) == []


@pytest.mark.parametrize("model_cls", [NoNormNet, lambda: LayerNormNet(affine=False)],
                         ids=["no-norm", "non-affine-layernorm"])
@pytest.mark.parametrize("name", NORM_METHODS)
def test_model_without_norm_affine_is_refused_in_one_line(name: str, model_cls) -> None:
    model = model_cls()
    cls_name = type(model).__name__
    with pytest.raises(ValueError, match=rf"^{name}: {cls_name} has no BatchNorm/LayerNorm/"
                                         r"GroupNorm layer with affine parameters: "
                                         r"nothing to adapt$") as err:
        build_method(name, model)
    assert "\n" not in str(err.value)


def test_sar_refuses_a_model_whose_norms_are_all_skipped() -> None:
    with pytest.raises(ValueError, match=r"^sar: LayerNormNet has no .* with affine "
                                         r"parameters outside the skipped modules: "
                                         r"nothing to adapt$"):
        build_method("sar", LayerNormNet(), skip_exact=("feat_norm",))


def test_cotta_refuses_a_model_without_parameters() -> None:
    with pytest.raises(ValueError, match=r"^cotta: Parameterless has no parameters: "
                                         r"nothing to adapt$") as err:
        build_method("cotta", Parameterless())
    assert "\n" not in str(err.value)


# every baseline runs the base class's loop: five timed phases, one clock interval each
BASELINES = ("source", "bn_adapt", "tent", "eata", "sar", "cotta", "lame")
PHASES = ("forward_ms", "plan_ms", "backward_ms", "reforward_ms", "post_ms")


@pytest.mark.parametrize("name", BASELINES)
def test_baselines_time_phases_with_the_phase_clock(name: str, monkeypatch) -> None:
    """A fake PhaseClock.now advancing 1 s per call: the loop times each of its five phases
    as one interval (1 s); a method reading time.perf_counter itself, or timing a phase by
    hand inside the loop, would report something else."""
    # bn_adapt serves BatchNorm only (it refuses a LayerNorm net at build)
    net = TinyNet(map_norm=nn.BatchNorm2d(8)) if name == "bn_adapt" else LayerNormNet()
    meth = build_method(name, net, **options(name, reforward=True))
    ticks = itertools.count()
    monkeypatch.setattr(PhaseClock, "now", lambda self: float(next(ticks)))
    times = meth.step(batch()).times
    reported = {p: getattr(times, p) for p in PHASES}
    for phase, ms in reported.items():
        assert math.isclose(ms % 1000.0, 0.0, abs_tol=1e-9), (phase, ms)
        assert ms == 1000.0, (phase, ms)
    assert times.total_ms == sum(reported.values())

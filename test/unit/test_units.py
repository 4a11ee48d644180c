"""Unit/stage decomposition: exact stage composition, parameter coverage, MAC formulas."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.models import VisionTransformer

from tta_core.model.units import decompose
from tta_core.model.zoo import build_model


def _tiny_vit() -> VisionTransformer:
    return VisionTransformer(image_size=32, patch_size=16, num_layers=2, num_heads=2,
                             hidden_dim=32, mlp_dim=64, num_classes=10)


def _model(arch: str) -> tuple[nn.Module, int]:
    torch.manual_seed(0)
    if arch == "tiny_vit":
        return _tiny_vit(), 32
    return build_model(arch, 10), 32 if arch == "small_resnet" else 64


@pytest.mark.parametrize("arch", ["small_resnet", pytest.param("resnet18", marks=pytest.mark.slow),
                                  pytest.param("resnet50", marks=pytest.mark.slow),
                                  pytest.param("mobilenet_v2", marks=pytest.mark.slow), "tiny_vit"])
def test_stage_composition_equals_model(arch: str) -> None:
    model, size = _model(arch)
    staged = decompose(model, (3, size, size))
    model.eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        full = model(x)
        assert torch.equal(staged.forward_from(0, x), full)
        # running stages one by one and restarting at any stage gives the same logits
        h = x
        for s in range(len(staged.stages)):
            assert torch.equal(staged.forward_from(s, h), full)
            h = staged.stages[s].module(h)


@pytest.mark.parametrize("arch", ["small_resnet",
                                  pytest.param("mobilenet_v2", marks=pytest.mark.slow),
                                  "tiny_vit"])
def test_every_parameter_in_exactly_one_unit(arch: str) -> None:
    model, size = _model(arch)
    staged = decompose(model, (3, size, size))
    owned = [id(p) for u in staged.units for p in u.parameters()]
    assert len(owned) == len(set(owned))
    assert set(owned) == {id(p) for p in model.parameters()}
    assert sum(u.params for u in staged.units) == sum(p.numel() for p in model.parameters())


def test_units_in_forward_order_with_contiguous_stages() -> None:
    model, size = _model("resnet18")
    staged = decompose(model, (3, size, size))
    assert [u.index for u in staged.units] == list(range(len(staged.units)))
    assert staged.units[0].name == "conv1" and staged.units[-1].name == "fc"
    names = [u.name for u in staged.units]
    # torchvision BasicBlock runs bn2 before the downsample branch
    assert names.index("layer2.0.bn2") < names.index("layer2.0.downsample.0")
    small = [u.name for u in decompose(_model("small_resnet")[0], (3, 32, 32)).units]
    # so does ours: a shortcut ordered first would be charged the main branch's ∂x chain
    assert small.index("layer2.0.bn2") < small.index("layer2.0.downsample.0")
    start = staged.stage_start()
    for u in staged.units:
        st = staged.stages[u.stage]
        assert st.first_unit <= u.index < st.first_unit + st.n_units
        assert start[u.index] == st.first_unit
    assert len(staged.units) == 41 and len(staged.stages) == 10  # stem, 8 blocks, head


def test_resnet50_has_107_units() -> None:
    """AdaShadow §3.3 counts 107 layer-wise sub-problems for ResNet-50."""
    model, size = _model("resnet50")
    assert len(decompose(model, (3, size, size)).units) == 107


def test_mac_formulas() -> None:
    model, size = _model("small_resnet")
    staged = decompose(model, (3, size, size))
    conv1, bn1, fc = staged.units[0], staged.units[1], staged.units[-1]
    assert conv1.macs_fwd == 3 * 3 * 3 * 16 * 32 * 32
    assert bn1.macs_fwd == 2 * 16 * 32 * 32
    assert fc.macs_fwd == 64 * 10
    assert conv1.kind == "conv" and bn1.kind == "bn" and fc.kind == "linear"
    assert conv1.bytes_moved == 3 * 4 * (conv1.params + 3 * 32 * 32 + 16 * 32 * 32)
    expect_eta = (3 * conv1.macs_fwd / 1e11) / (conv1.bytes_moved / 2e10)
    assert conv1.eta == pytest.approx(expect_eta)
    # depthwise conv: groups divide the input channels
    mb, _ = _model("mobilenet_v2")
    dw = next(u for u in decompose(mb, (3, 64, 64)).units
              if u.kind == "conv" and u.module.groups > 1)
    m = dw.module
    assert dw.name == "features.1.conv.0.0" and m.groups == m.in_channels == 32
    assert dw.macs_fwd == 9 * 1 * 32 * 32 * 32  # K*K*Cin/groups*Cout*Hout*Wout at 64 px


def test_vit_units_include_attention_projections() -> None:
    model, size = _model("tiny_vit")
    staged = decompose(model, (3, size, size))
    kinds = [u.kind for u in staged.units]
    assert kinds.count("attn") == 4 and kinds.count("ln") == 5
    stem = staged.units[0]
    assert any(p is model.class_token for p in stem.parameters())


def test_unknown_parameterised_module_is_named() -> None:
    model, size = _model("small_resnet")
    model.bn1 = nn.Embedding(4, 16)  # a 2-D weight: no unit kind
    with pytest.raises(ValueError, match="bn1"):
        decompose(model, (3, size, size))


def test_unsupported_model_rejected() -> None:
    # a model of no known family is cut from its fx graph (test_generic_stages)
    assert decompose(nn.Sequential(nn.Linear(3, 2)), (3,)).arch == "generic"
    with pytest.raises(ValueError, match="mobilenet_v2"):
        decompose(build_model("small_resnet", 10), (3, 32, 32), arch="mobilenet_v2")


class _ConvReluBn(nn.Module):
    """conv -> bn -> conv, then an in-place op before the second bn."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)
        self.c2, self.b2 = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b1(self.c1(x))
        return self.b2(self.c2(h).mul_(2.0))


def test_producers_are_the_layers_whose_output_a_unit_reads_unchanged() -> None:
    """Unit.producer (the reforward replays its output, §4 reuse): the conv that feeds a
    BN directly; none when the output was changed in place on the way, none for a unit
    fed through a reshape (the classifier after the pooling)."""
    from tta_core.model.units import _owners, _producers, _trace

    model = _ConvReluBn()
    records = _trace(model, _owners(model, []), (3, 8, 8))
    assert [r.name for r in records] == ["c1", "b1", "c2", "b2"]
    assert _producers(records) == [None, 0, 1, None]  # b2 reads c2's output doubled
    model, size = _model("resnet18")
    staged = decompose(model, (3, size, size))
    by_name = {u.name: u for u in staged.units}
    for u in staged.units:
        if u.kind == "bn":  # every torchvision ResNet BN reads its conv's output
            conv = u.name.rsplit(".", 1)[0] + ".0" if "downsample" in u.name else \
                u.name.replace("bn", "conv")
            assert u.producer == by_name[conv].index, u.name
    assert by_name["fc"].producer is None and by_name["conv1"].producer is None

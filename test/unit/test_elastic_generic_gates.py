"""ElasticDNN's gates on models outside the known ResNet classes (tta_core.elasticdnn.gates
`traced_sites`): a user's own ResNet, MobileNetV2's dense conv pairs, depthwise convs left
unsliced, and a gated card of a user's factory loading through the card route."""

from __future__ import annotations

import copy
import sys
import textwrap

import pytest
import torch
from helpers.models import randomize_gates, settle_bn
from torch import nn
from torchvision import models as tvm

from tta_core.elasticdnn.gates import load_gated, make_gated, save_gated, traced_sites
from tta_core.elasticdnn.surrogate import extract_surrogate
from tta_core.model.source import ModelCard, load_card

USER_MODEL = '''
from torch import nn


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.a = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.na = nn.BatchNorm2d(cout)
        self.b = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.nb = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                   nn.BatchNorm2d(cout)) if stride > 1 or cin != cout
                     else nn.Identity())

    def forward(self, x):
        y = nn.functional.relu(self.na(self.a(x)))
        return nn.functional.relu(self.nb(self.b(y)) + self.skip(x))


def tiny_resnet(num_classes=4, width=8):
    return nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                         nn.ReLU(), Block(width, width, 1), Block(width, 2 * width, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(2 * width, num_classes))
'''


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
    """The module `userzoo_gates` (a user's own ResNet factory) importable from tmp_path."""
    (tmp_path / "userzoo_gates.py").write_text(textwrap.dedent(USER_MODEL))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("userzoo_gates", None)
    import userzoo_gates

    yield userzoo_gates
    sys.modules.pop("userzoo_gates", None)


def _sq(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b) ** 2).mean())


def test_a_user_resnet_is_gated_at_its_block_internal_convs(user_module) -> None:
    model = settle_bn(user_module.tiny_resnet(), (4, 3, 16, 16))
    sites = traced_sites(model)
    # only each block's first conv: the stem feeds a residual sum, b's BN feeds an add
    assert [(s.conv, s.bn, s.next_conv) for s in sites] == [
        ("3.a", "3.na", "3.b"), ("4.a", "4.na", "4.b")]
    master = make_gated(copy.deepcopy(model)).eval()
    x = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(master(x), model(x))  # fresh gates are 1: the source's outputs


def test_a_user_resnet_surrogate_reproduces_the_sparse_master(user_module) -> None:
    master = randomize_gates(make_gated(settle_bn(user_module.tiny_resnet(), (4, 3, 16, 16))))
    master.eval()
    x = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    sur = extract_surrogate(master, x, 0.5)
    with torch.no_grad(), master.sparsity_set_to(0.5):
        assert _sq(sur.model(x), master(x)) < 1e-8
    mods = dict(sur.model.named_modules())
    assert mods["4.a"].out_channels == 8 and mods["4.b"].in_channels == 8  # of 16


def test_mobilenet_v2_gates_dense_pairs_and_never_a_depthwise_conv() -> None:
    model = settle_bn(tvm.mobilenet_v2(num_classes=5, width_mult=0.25), (4, 3, 32, 32))
    mods = dict(model.named_modules())
    sites = traced_sites(model)
    assert sites, "the projection -> next expansion pairs (no residual between) are sliceable"
    for s in sites:
        assert mods[s.conv].groups == 1 and mods[s.next_conv].groups == 1
        assert mods[s.next_conv].kernel_size == (1, 1)  # the next block's expansion
    master = randomize_gates(make_gated(model)).eval()
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    sur = extract_surrogate(master, x, 0.5)
    with torch.no_grad(), master.sparsity_set_to(0.5):
        assert _sq(sur.model(x), master(x)) < 1e-8


def test_scope_all_gates_depthwise_convs_as_masks() -> None:
    model = settle_bn(tvm.mobilenet_v2(num_classes=5, width_mult=0.25), (4, 3, 32, 32))
    master = make_gated(model, scope="all")
    mods = dict(master.base.named_modules())
    depthwise = [n for n in master.gated if mods[n].groups > 1]
    assert depthwise and not {s.conv for s in master.sites} & set(depthwise)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(master.eval()(x), model.eval()(x))


def test_an_untraceable_model_is_refused_in_one_line() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return self.c(x) if float(x.sum()) > 0 else self.c(-x)  # data-dependent

    with pytest.raises(ValueError, match=r"torch\.fx cannot trace") as info:
        make_gated(Branchy())
    assert "\n" not in str(info.value)


def test_a_gated_card_of_a_user_factory_loads_through_the_card_route(user_module,
                                                                    tmp_path) -> None:
    base = settle_bn(user_module.tiny_resnet(), (4, 3, 16, 16))
    master = randomize_gates(make_gated(base)).eval()
    card = ModelCard(arch="tiny_resnet", factory="userzoo_gates:tiny_resnet",
                     kwargs={"num_classes": 4}, num_classes=4, image_size=16,
                     class_names=["a", "b", "c", "d"], mean=[0.5] * 3, std=[0.25] * 3,
                     checkpoint="unused.safetensors")
    path = save_gated(master, tmp_path / "user_elastic", card)
    written = load_card(path)
    assert written.kwargs["base_factory"] == "userzoo_gates:tiny_resnet"
    back = load_gated(path)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(back(x), master(x))

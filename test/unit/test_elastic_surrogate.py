"""ElasticDNN surrogate extraction (tta_core.elasticdnn.surrogate): the highest-entropy sample,
physical slicing, and the surrogate reproducing the master on x* (squared error < 1e-4)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import randomize_gates, settle_bn, signs_batch, small_source
from torch import nn
from torchvision import models as tvm

from tta_core.elasticdnn.gates import ChannelGate, kept_count, make_gated
from tta_core.elasticdnn.surrogate import extract_surrogate, highest_entropy_sample


def sq_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b) ** 2).sum())


@pytest.fixture(scope="module")
def master():
    return randomize_gates(make_gated(small_source()), seed=1).eval()


def test_highest_entropy_sample_is_the_brute_force_argmax(master) -> None:
    batch = signs_batch()
    x = highest_entropy_sample(master, batch)
    with torch.no_grad():
        ents = [float(-(lp.exp() * lp).sum()) for lp in torch.log_softmax(master(batch), 1)]
    assert torch.equal(x, batch[ents.index(max(ents))][None])
    with pytest.raises(ValueError, match="non-empty"):
        highest_entropy_sample(master, batch[:0])


@pytest.mark.parametrize("sparsity, keep", [(0.0, 1.0), (0.5, 0.5), (0.7, 0.3), (0.8, 0.3),
                                            (0.5, 0.9)])
def test_surrogate_reproduces_the_master_when_keep_covers_the_active_gates(
        master, sparsity, keep) -> None:
    x = highest_entropy_sample(master, signs_batch())
    master.set_sparsity(sparsity)
    try:
        sur = extract_surrogate(master, x, keep)
        with torch.no_grad():
            assert sq_err(sur.model(x), master(x)) < 1e-4
            active = master.gate_values(x)
    finally:
        master.set_sparsity(0.0)
    for name, idx in sur.kept.items():
        c = active[name].shape[1]
        assert len(idx) == kept_count(keep, c)
        assert torch.equal(idx, torch.sort(idx).values)
        assert set((active[name][0] > 0).nonzero().flatten().tolist()) <= set(idx.tolist())


def test_below_the_active_share_it_reproduces_the_sparser_master(master) -> None:
    """keep 0.3 from a master at sparsity 0: the surrogate drops channels the master uses,
    so it differs from the master at 0 and equals the master at sparsity 0.7."""
    x = highest_entropy_sample(master, signs_batch())
    sur = extract_surrogate(master, x, 0.3)
    assert sur.master_sparsity == pytest.approx(0.7)
    with torch.no_grad():
        dense = master(x)
        with master.sparsity_set_to(0.7):
            sparse = master(x)
        assert sq_err(sur.model(x), sparse) < 1e-4
        assert sq_err(sur.model(x), dense) > 1e-2
    assert master.sparsity == 0.0


def test_surrogate_is_a_plain_sliced_network(master) -> None:
    x = highest_entropy_sample(master, signs_batch())
    sur = extract_surrogate(master, x, 0.3)
    assert not any(isinstance(m, ChannelGate) for m in sur.model.modules())
    assert not any(m._forward_hooks for m in sur.model.modules())
    mods = dict(sur.model.named_modules())
    for site in sur.sites:
        k = len(sur.kept[site.conv])
        assert mods[site.conv].weight.shape[0] == k == mods[site.bn].weight.shape[0]
        assert mods[site.bn].running_mean.shape == (k,)
        assert mods[site.next_conv].weight.shape[1] == k
    n_master = sum(p.numel() for p in master.base.parameters())
    assert sum(p.numel() for p in sur.model.parameters()) < 0.6 * n_master
    # the master is untouched: its convs keep every channel
    assert dict(master.base.named_modules())["layer3.0.conv1"].weight.shape[0] == 64
    with pytest.raises(ValueError, match="keep must be in"):
        extract_surrogate(master, x, 0.0)


@pytest.mark.parametrize("build, n_sites", [
    (lambda: tvm.resnet18(num_classes=10), 8),
    pytest.param(lambda: tvm.resnet50(num_classes=10), 32, marks=pytest.mark.slow),
])
def test_slicing_keeps_torchvision_resnets_valid(build, n_sites) -> None:
    torch.manual_seed(0)
    shape = (4, 3, 64, 64)
    master = randomize_gates(make_gated(settle_bn(build(), shape)), std=0.01).eval()
    batch = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x = highest_entropy_sample(master, batch)
    master.set_sparsity(0.7)
    sur = extract_surrogate(master, x, 0.3)
    assert len(sur.kept) == n_sites
    with torch.no_grad():
        ref = master(x)
        out = sur.model(x)
        assert sur.model(batch).shape == (4, 10)
    assert float(ref.abs().max()) > 0.1  # not a trivially zero output
    assert sq_err(out, ref) < 1e-4
    convs = [m for m in sur.model.modules() if isinstance(m, nn.Conv2d)]
    assert all(c.weight.shape[0] == c.out_channels and c.weight.shape[1] == c.in_channels
               for c in convs)


def test_a_channels_last_master_gives_a_channels_last_surrogate_with_the_same_outputs() -> None:
    """Methods may run the master in channels_last (tta_core.model.memory_format); slicing
    leaves NCHW weights, so the surrogate is converted to the master's format; it still
    reproduces the master on x*."""
    master = randomize_gates(make_gated(small_source()), seed=1).eval()
    master.to(memory_format=torch.channels_last)
    x = highest_entropy_sample(master, signs_batch())
    master.set_sparsity(0.7)
    sur = extract_surrogate(master, x, 0.3)
    with torch.no_grad():
        assert sq_err(sur.model(x), master(x)) < 1e-4
    convs = [m for m in sur.model.modules() if isinstance(m, nn.Conv2d)]
    assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
    nchw = extract_surrogate(make_gated(small_source()).eval(), x, 0.3).model
    assert all(m.weight.is_contiguous() for m in nchw.modules() if isinstance(m, nn.Conv2d))

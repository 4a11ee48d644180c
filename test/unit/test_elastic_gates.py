"""ElasticDNN gated master (tta_core.elasticdnn.gates): FBS gates, winner-take-all, where the
gate multiplies, supported models, card round trip."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from helpers import CARD
from helpers.models import randomize_gates, small_source
from torch import nn
from torchvision import models as tvm

from tta_core.elasticdnn.gates import (
    GATED_FACTORY,
    ChannelGate,
    GatedModel,
    fold_extra_gates,
    kept_count,
    load_gated,
    make_gated,
    save_gated,
    winner_take_all,
)
from tta_core.elasticdnn.train import (
    ElasticTrainConfig,
    recalibrate_bn,
    sandwich_loss,
    train_master,
)
from tta_core.model.source import load_card, load_source
from tta_core.model.zoo import SmallResNet


def test_fresh_gates_are_one_and_the_master_computes_the_source() -> None:
    src = small_source()
    master = make_gated(copy.deepcopy(src)).eval()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(master(x), src(x))
    values = master.gate_values(x)
    assert set(values) == set(master.gated)
    assert all(torch.equal(v, torch.ones_like(v)) for v in values.values())


def test_sites_are_block_internal_convs_only() -> None:
    assert make_gated(SmallResNet(num_classes=5)).gated == (
        "layer1.0.conv1", "layer2.0.conv1", "layer3.0.conv1")
    r18 = make_gated(tvm.resnet18(num_classes=5))
    assert len(r18.gated) == 8 and all(n.endswith(".conv1") for n in r18.gated)
    r50 = make_gated(tvm.resnet50(num_classes=5))
    assert len(r50.gated) == 32
    assert {s.next_conv.rsplit(".", 1)[1] for s in r50.sites} == {"conv2", "conv3"}
    # residual outputs (conv2 of a basic block, conv3 of a bottleneck) are never gated
    assert not any(n.endswith(("conv2",)) for n in r18.gated)
    assert not any(n.endswith("conv3") for n in r50.gated)


@pytest.mark.parametrize("model, words", [
    (lambda: nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                           nn.Conv2d(8, 8, 3, groups=8), nn.BatchNorm2d(8), nn.ReLU(),
                           nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)),
     "Sequential has no conv to gate"),
    (lambda: tvm.resnext50_32x4d(num_classes=5), "grouped convs"),
    (lambda: make_gated(SmallResNet(num_classes=5)), "already gated"),
])
def test_unsupported_models_are_refused_in_one_line(model, words) -> None:
    with pytest.raises(ValueError, match=words) as info:
        make_gated(model())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("sparsity", [0.0, 0.2, 0.5, 0.7, 0.8, 0.95])
def test_winner_take_all_keeps_the_top_channels_of_each_sample(sparsity) -> None:
    g = torch.rand(6, 13, generator=torch.Generator().manual_seed(3))
    out = winner_take_all(g, sparsity)
    k = max(1, math.ceil((1 - sparsity) * 13 - 1e-9))
    for row, orig in zip(out, g, strict=True):
        keep = sorted(range(13), key=lambda i: -float(orig[i]))[:k]  # brute force
        assert sorted(int(i) for i in row.nonzero()) == sorted(keep)
        assert torch.equal(row[keep], orig[keep])


def test_winner_take_all_breaks_ties_by_the_lower_channel() -> None:
    """A fresh master's gates are all 1: the kept channels must not depend on the device's
    topk (CPU and CUDA break ties differently), so the first k channels win."""
    g = torch.ones(3, 10)
    g[1, 7] = 2.0  # one clear winner, then ties
    out = winner_take_all(g, 0.6)
    assert out[0].nonzero().view(-1).tolist() == [0, 1, 2, 3]
    assert out[1].nonzero().view(-1).tolist() == [0, 1, 2, 7]


def test_kept_count_is_not_fooled_by_float_error() -> None:
    assert 1 - (1 - 0.3) != 0.3 and kept_count(1 - (1 - 0.3), 10) == 3
    assert kept_count(0.3, 64) == 20 and kept_count(0.01, 8) == 1 and kept_count(1.0, 8) == 8


def test_gate_multiplies_the_bn_output_per_sample() -> None:
    """The master equals, sample by sample, the plain network whose BN gamma/beta are scaled
    by that sample's gate values (the fold the surrogate relies on)."""
    master = randomize_gates(make_gated(small_source())).eval()
    master.set_sparsity(0.5)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = master(x)
        values = master.gate_values(x)
        for i in range(len(x)):
            plain = master.plain_base().eval()
            mods = dict(plain.named_modules())
            for site in master.sites:
                bn, g = mods[site.bn], values[site.conv][i]
                bn.weight.mul_(g)
                bn.bias.mul_(g)
            assert torch.allclose(plain(x[i:i + 1])[0], out[i], atol=1e-5)
    # half the channels (rounded up) of each gate are non-zero at sparsity 0.5
    for v in values.values():
        assert int((v > 0).sum(1).max()) <= math.ceil(v.shape[1] / 2)


def test_sparsity_is_checked_and_restored() -> None:
    master = make_gated(SmallResNet(num_classes=5))
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=f"sparsity must be in \\[0, 1\\), got {bad}"):
            master.set_sparsity(bad)
    master.set_sparsity(0.3)
    with master.sparsity_set_to(0.8):
        assert all(g.sparsity == 0.8 for g in master.gates.values())
    assert master.sparsity == 0.3


def test_deepcopy_and_plain_base_do_not_share_gates() -> None:
    master = randomize_gates(make_gated(small_source())).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = master(x)
        twin = copy.deepcopy(master)
        randomize_gates(twin, seed=9)
        assert not torch.allclose(twin(x), before)
        assert torch.equal(master(x), before)
        plain = master.plain_base().eval()
        assert not any(m._forward_hooks for m in plain.modules())
        assert torch.equal(plain(x), small_source()(x))  # ungated = the source net


def test_gate_starts_at_one_for_any_input() -> None:
    gate = ChannelGate(8, 16)
    g = gate(torch.randn(5, 8, 4, 4))
    assert torch.equal(g, torch.ones(5, 16))


def test_card_round_trip_through_the_model_card_route(tmp_path) -> None:
    master = randomize_gates(make_gated(small_source())).eval()
    card_path = save_gated(master, tmp_path / "gated", load_card(CARD),
                           clean_accuracy=0.5, metadata={"note": "test"})
    raw = json.loads(card_path.read_text())
    assert raw["factory"] == GATED_FACTORY and raw["kwargs"]["base_arch"] == "small_resnet"
    assert raw["checkpoint"] == "gated.safetensors"
    loaded = load_gated(card_path)
    model, card = load_source(card_path)  # the ordinary route builds the same thing
    assert isinstance(model, GatedModel) and card.num_classes == 22
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(x), master(x)) and torch.equal(model(x), master(x))
    with pytest.raises(ValueError, match="is not a gated master"):
        load_gated(CARD)


def _bn_stats(model: nn.Module) -> list[torch.Tensor]:
    return [t.clone() for m in model.modules() if isinstance(m, nn.BatchNorm2d)
            for t in (m.running_mean, m.running_var)]


def test_sandwich_rule_updates_running_stats_in_the_full_pass_only() -> None:
    master = randomize_gates(make_gated(small_source()), seed=4).train()
    ref = copy.deepcopy(master)
    x = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    y = torch.arange(8)
    loss = sandwich_loss(master, x, y, 0.8, ElasticTrainConfig(), torch.Generator())
    with torch.no_grad():
        ref(x)  # one full-network pass
    assert all(torch.allclose(a, b, atol=1e-6)
               for a, b in zip(_bn_stats(master), _bn_stats(ref), strict=True))
    assert loss > 0 and master.sparsity == 0.0
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for g in master.gates.values() for p in g.parameters())
    momenta = {m.momentum for m in master.modules() if isinstance(m, nn.BatchNorm2d)}
    assert momenta == {0.1}  # restored


def test_recalibrated_bn_holds_the_plain_batch_statistics() -> None:
    master = make_gated(small_source())
    x = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(8))
    recalibrate_bn(master, x, batch=32)
    assert not master.training
    with torch.no_grad():
        z = master.base.conv1(x)
    bn = master.base.bn1
    assert torch.allclose(bn.running_mean, z.mean((0, 2, 3)), atol=1e-5)
    assert torch.allclose(bn.running_var, z.var((0, 2, 3), unbiased=True), atol=1e-4)


@pytest.mark.slow
def test_train_master_runs_and_moves_the_gates() -> None:
    cfg = ElasticTrainConfig(source_card=CARD, warmup_epochs=1, stage_epochs=1,
                             stages=(0.5,), train_samples=64, val_samples=32, batch_size=32,
                             eval_sparsities=(0.0, 0.5), calibration_samples=64, threads=1)
    res = train_master(cfg, progress=False)
    assert res.steps == 4 and set(res.accuracy) == set(res.batch_accuracy) == {0.0, 0.5}
    fresh = ChannelGate(16, 16)
    gate = res.master.gates["layer1_0_conv1"]
    assert not torch.equal(gate.fc2.weight, fresh.fc2.weight)  # trained away from 0
    with pytest.raises(ValueError, match="stages must be sparsities"):
        ElasticTrainConfig(stages=(0.9, 1.0)).validate()


# ------------------------------------------------------------ scope "all": every conv gated
def test_scope_all_gates_every_conv_followed_by_a_batchnorm() -> None:
    m = make_gated(SmallResNet(num_classes=5), scope="all")
    assert m.gated == ("conv1", "layer1.0.conv1", "layer1.0.conv2", "layer2.0.conv1",
                       "layer2.0.conv2", "layer2.0.downsample.0", "layer3.0.conv1",
                       "layer3.0.conv2", "layer3.0.downsample.0")
    # the sliceable sites stay the block-internal ones; the extra ones pair conv and BN
    assert [s.conv for s in m.sites] == ["layer1.0.conv1", "layer2.0.conv1", "layer3.0.conv1"]
    assert [(s.bn, s.next_conv) for s in m.extra][:2] == [("bn1", ""), ("layer1.0.bn2", "")]
    assert set(m.gates) == {n.replace(".", "_") for n in m.gated}
    # torchvision: stem + every block conv + downsample convs
    assert len(make_gated(tvm.resnet18(num_classes=5), scope="all").gated) == 1 + 16 + 3
    assert len(make_gated(tvm.resnet50(num_classes=5), scope="all").gated) == 1 + 48 + 4
    with pytest.raises(ValueError, match="gate scope 'every'"):
        make_gated(SmallResNet(num_classes=5), scope="every")


def test_scope_all_card_round_trip(tmp_path) -> None:
    """A scope-"all" master saves as a card (kwarg gate_scope) and loads with every gate;
    a card without the kwarg (the block scope's) still builds block gates."""
    master = randomize_gates(make_gated(small_source(), scope="all")).eval()
    master.set_sparsity(0.5)
    card_path = save_gated(master, tmp_path / "all", load_card(CARD))
    assert json.loads(card_path.read_text())["kwargs"]["gate_scope"] == "all"
    back = load_gated(card_path)
    assert back.scope == "all" and back.gated == master.gated
    back.set_sparsity(0.5)
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(back(x), master(x))
    block = save_gated(randomize_gates(make_gated(small_source())), tmp_path / "b",
                       load_card(CARD))
    assert "gate_scope" not in json.loads(block.read_text())["kwargs"]
    assert load_gated(block).scope == "block"


def test_teacher_soft_labels_mix_into_the_label_loss() -> None:
    """`teacher` share t: (1 - t) CE + t · soft-label CE; one-hot teacher = plain CE."""
    from tta_core.elasticdnn.train import _label_loss

    gen = torch.Generator().manual_seed(0)
    logits, y = torch.randn(5, 4, generator=gen), torch.tensor([0, 1, 2, 3, 0])
    ce = nn.functional.cross_entropy(logits, y)
    cfg = ElasticTrainConfig(teacher=0.25)
    assert torch.allclose(_label_loss(logits, y, nn.functional.one_hot(y, 4).float(), cfg), ce)
    uniform = torch.full((5, 4), 0.25)
    want = 0.75 * ce + 0.25 * -torch.log_softmax(logits, 1).mean(1).mean()
    assert torch.allclose(_label_loss(logits, y, uniform, cfg), want)
    with pytest.raises(ValueError, match="teacher must be in \\[0, 1\\], got 2"):
        ElasticTrainConfig(teacher=2).validate()


def test_scope_all_fresh_gates_compute_the_source_and_fold_into_a_surrogate() -> None:
    from tta_core.elasticdnn.surrogate import extract_surrogate

    src = small_source()
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    master = make_gated(copy.deepcopy(src), scope="all").eval()
    with torch.no_grad():
        assert torch.equal(master(x), src(x))
    randomize_gates(master).set_sparsity(0.5)
    sur = extract_surrogate(master, x[:1], 0.5)  # folds the extra gates into its BNs
    with torch.no_grad():
        ref = master(x[:1])
        after = sur.model.eval()(x[:1])
        plain = master.plain_base()
        fold_extra_gates(master, plain, x[:1], sur.master_sparsity)  # what the cut folded
    assert torch.allclose(after, ref, atol=1e-4)
    mods, folded = dict(plain.named_modules()), dict(sur.model.named_modules())
    for site in master.extra:  # the extra gates' scales live in the surrogate's BNs
        assert torch.equal(folded[site.bn].weight, mods[site.bn].weight)
        assert not torch.equal(mods[site.bn].weight, dict(src.named_modules())[site.bn].weight)
    # every extra gate zeroes half its channels (rounded down) on that sample
    values = master.gate_values(x[:1])
    for site in master.extra:
        assert int((values[site.conv] > 0).sum()) <= math.ceil(values[site.conv].shape[1] / 2)

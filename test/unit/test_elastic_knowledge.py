"""ElasticDNN domain knowledge Θ* (tta_core.elasticdnn.knowledge): Eqs. 3-4 on hand-built
tensors, the master update modes of write_back, the second pre-training loss on the shipped
cards, checkpoint round-trip, and what a checkpoint without Θ* gets."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from helpers.models import randomize_gates, signs_batch, small_source

from tta_core.elasticdnn.filter_update import (
    filter_optimizer,
    filter_scores,
    im_loss,
    mask_gradients,
    select_filters,
    write_back,
)
from tta_core.elasticdnn.gates import load_gated, make_gated
from tta_core.elasticdnn.knowledge import (
    DomainKnowledge,
    absorb,
    attach_knowledge,
    knowledge_layers,
    knowledge_of,
    knowledge_rank,
    require_knowledge,
    save_master,
)
from tta_core.elasticdnn.surrogate import extract_surrogate
from tta_core.errors import InputError
from tta_core.model.source import load_card

SHIPPED = ("checkpoints/small_resnet_signs32_elastic.json",
           "checkpoints/resnet18_cifar_w32_signs64_elastic.json")


def hand_built() -> DomainKnowledge:
    """One layer 'c' of 2 filters of shape (1, 1, 2), K = 2: w = [[1, 0], [.5, .5]],
    Θ* = [[1, 2], [3, 4]]."""
    kn = DomainKnowledge({"c": (2, 1, 1, 2)}, share=1.0)
    kn.relevances("c").copy_(torch.tensor([[1.0, 0.0], [0.5, 0.5]]))
    kn.matrices("c").copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]).view(2, 1, 1, 2))
    return kn


def test_eq3_then_eq4_on_hand_built_tensors() -> None:
    kn = hand_built()
    delta = torch.tensor([[1.0, 0.0], [0.0, 2.0]]).view(2, 1, 1, 2)
    kn.store("c", delta)  # Eq. 3: θ*_k += Σ_j w(j,k) Δθ_j = Θ* + wᵀΔ = [[2, 3], [3, 5]]
    assert torch.equal(kn.matrices("c").view(2, 2), torch.tensor([[2.0, 3.0], [3.0, 5.0]]))
    weight = torch.zeros(2, 1, 1, 2)
    kn.recall("c", weight)  # Eq. 4: θ_0 = θ*_0, θ_1 = (θ*_0 + θ*_1) / 2
    assert torch.equal(weight.view(2, 2), torch.tensor([[2.0, 3.0], [2.5, 4.0]]))


def test_k_below_n_spreads_a_filters_change_to_related_filters() -> None:
    """K = 2 < N = 3, w = [[1, 0], [0, 1], [1, 1]], Θ* = [[2], [3]] (tied: θ = [2, 3, 5]).
    A change of filter 2 alone by 1: Eq. 3 Θ* += wᵀΔ = [[3], [4]], Eq. 4 θ = [3, 4, 7]: the
    untouched filters 0 and 1 move by 1 each and filter 2 by 2 (w wᵀ row 2 = [1, 1, 2]),
    where the identity update would give [2, 3, 6]."""
    kn = DomainKnowledge({"c": (3, 1, 1, 1)}, share=2 / 3)
    kn.relevances("c").copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
    kn.matrices("c").copy_(torch.tensor([2.0, 3.0]).view(2, 1, 1, 1))
    weight = torch.zeros(3, 1, 1, 1)
    kn.recall("c", weight)
    assert weight.flatten().tolist() == [2.0, 3.0, 5.0]
    kn.store("c", torch.tensor([0.0, 0.0, 1.0]).view(3, 1, 1, 1))
    assert kn.matrices("c").flatten().tolist() == [3.0, 4.0]
    kn.recall("c", weight)
    assert weight.flatten().tolist() == [3.0, 4.0, 7.0]


def test_similarity_gauge_relevances_are_the_filters_gram_matrix() -> None:
    """fit(gauge="similarity") with K = N: tied exactly, w wᵀ = N θθᵀ / ‖θ‖² (trace N), not
    orthonormal; with K < N `project` makes the tie exact at rank K."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 6, 3, bias=False)
    base = torch.nn.Sequential()
    base.add_module("c", conv)
    kn = DomainKnowledge({"c": tuple(conv.weight.shape)}, share=1.0)
    kn.fit(base, gauge="similarity")
    flat = conv.weight.detach().reshape(6, -1).double()
    w = kn.relevances("c").double()
    assert float(kn.tie_loss(base).detach()) < 1e-10
    assert torch.allclose(w @ w.t(), 6 * flat @ flat.t() / flat.pow(2).sum(), atol=1e-5)
    assert float((w.t() @ w - torch.eye(6, dtype=w.dtype)).abs().max()) > 0.1
    low = DomainKnowledge({"c": tuple(conv.weight.shape)}, share=0.5)
    low.fit(base, gauge="similarity")
    assert float(low.tie_loss(base).detach()) > 1e-3
    low.project(base)
    assert float(low.tie_loss(base).detach()) < 1e-10
    assert int(torch.linalg.matrix_rank(conv.weight.detach().reshape(6, -1))) == 3
    with pytest.raises(ValueError, match=r"knowledge gauge must be one of .*got 'x'"):
        low.fit(base, gauge="x")
    combined = low.combine("c").clone()
    low.orthonormalize()  # the same combinations, orthonormal relevances
    w = low.relevances("c")
    assert torch.allclose(low.combine("c"), combined, atol=1e-5)
    assert torch.allclose(w.t() @ w, torch.eye(3), atol=1e-5)


def test_tie_loss_is_the_papers_sum_of_squares() -> None:
    kn = hand_built()
    conv = torch.nn.Conv2d(1, 2, (1, 2), bias=False)
    base = torch.nn.Sequential()
    base.add_module("c", conv)
    with torch.no_grad():
        conv.weight.copy_(torch.tensor([[1.0, 2.0], [2.0, 4.0]]).view(2, 1, 1, 2))
    # w Θ* = [[1, 2], [2, 3]]: residual [[0, 0], [0, 1]] -> 1
    loss = kn.tie_loss(base)
    assert float(loss.detach()) == 1.0
    loss.backward()
    assert torch.equal(conv.weight.grad.view(2, 2), torch.tensor([[0.0, 0.0], [0.0, 2.0]]))


def test_store_refuses_a_delta_of_the_wrong_shape() -> None:
    with pytest.raises(ValueError, match=r"delta of c has shape \(3, 1, 1, 2\)"):
        hand_built().store("c", torch.zeros(3, 1, 1, 2))


@pytest.mark.parametrize("share, n, k", [(1.0, 16, 16), (0.5, 16, 8), (0.3, 10, 3)])
def test_knowledge_rank(share, n, k) -> None:
    assert knowledge_rank(share, n) == k


def test_knowledge_rank_refuses_a_bad_share() -> None:
    with pytest.raises(ValueError, match="knowledge share must be in \\(0, 1\\], got 0"):
        knowledge_rank(0.0, 4)


@pytest.fixture(scope="module")
def master():
    m = randomize_gates(make_gated(small_source()), seed=2).eval()
    attach_knowledge(m)
    return m


def adapted_surrogate(master, steps: int = 2):
    x = signs_batch(16, seed=5)
    sur = extract_surrogate(master, x[:1], 0.5)
    sur.model.train()
    mask_gradients(sur, select_filters(filter_scores(sur, x), 0.8))
    opt = filter_optimizer(sur, lr=0.05)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        im_loss(sur.model(x)).backward()
        opt.step()
    return sur


def test_fit_ties_every_surrogate_layer_exactly(master) -> None:
    kn = knowledge_of(master)
    assert kn.layers == knowledge_layers(master) == ("layer1.0.conv1", "layer1.0.conv2",
                                                    "layer2.0.conv1", "layer2.0.conv2",
                                                    "layer3.0.conv1", "layer3.0.conv2")
    assert float(kn.tie_loss(master.base).detach()) < 1e-9
    for n in kn.layers:  # K = N and orthonormal relevances
        w = kn.relevances(n)
        assert torch.allclose(w @ w.t(), torch.eye(len(w)), atol=1e-5)


def test_write_back_modes(master) -> None:
    """knowledge with orthonormal w moves the master by the whole change (w wᵀ = I),
    averaging by half of it, none not at all; Θ* stays tied."""
    sur = adapted_surrogate(copy.deepcopy(master))
    origin = copy.deepcopy(master.base.state_dict())
    moved = {}
    for mode in ("knowledge", "averaging", "none"):
        m = copy.deepcopy(master)
        write_back(m, sur, mode)
        moved[mode] = {k: v - origin[k] for k, v in m.base.state_dict().items()
                       if v.is_floating_point()}
        if mode == "knowledge":
            assert float(knowledge_of(m).tie_loss(m.base).detach()) < 1e-9
    assert all(not bool(v.any()) for v in moved["none"].values())
    changed = [k for k, v in moved["averaging"].items() if v.abs().max() > 1e-7]
    assert any(k.endswith("conv1.weight") for k in changed)
    for k in moved["averaging"]:
        assert torch.allclose(moved["knowledge"][k], 2 * moved["averaging"][k], atol=2e-6), k


def test_write_back_knowledge_mixes_filters_by_relevance(master) -> None:
    """A non-orthogonal w: the layer moves by w wᵀ Δ (Eq. 3 then Eq. 4), not by Δ."""
    m = copy.deepcopy(master)
    kn = knowledge_of(m)
    name = "layer1.0.conv1"
    conv = dict(m.base.named_modules())[name]
    with torch.no_grad():
        w = torch.eye(16) + 0.1 * torch.ones(16, 16)
        kn.relevances(name).copy_(w)
        kn.solve(m.base)
    sur = adapted_surrogate(copy.deepcopy(m))
    before = conv.weight.detach().clone()
    delta = torch.zeros_like(before)
    delta[sur.kept[name]] = dict(sur.model.named_parameters())[f"{name}.weight"].detach() \
        - sur.origin[f"{name}.weight"]
    write_back(m, sur, "knowledge")
    expect = before + (w @ w.t() @ delta.reshape(16, -1)).reshape(delta.shape)
    assert torch.allclose(conv.weight, expect, atol=1e-5)


def test_absorb_keeps_an_in_place_change_with_orthonormal_relevances(master) -> None:
    m = copy.deepcopy(master)
    conv = dict(m.base.named_modules())["layer2.0.conv2"]
    with torch.no_grad():
        conv.weight[3] += 0.25
    after = conv.weight.detach().clone()
    absorb(m)
    assert torch.allclose(conv.weight, after, atol=1e-5)
    assert float(knowledge_of(m).tie_loss(m.base).detach()) < 1e-9


def test_write_back_knowledge_keeping_the_masters_bn(master) -> None:
    """master_bn "keep": Θ*'s filters move exactly as with "change", BN affine and conv
    biases stay bit-identical, BN statistics still take the change."""
    sur = adapted_surrogate(copy.deepcopy(master))
    moved = {}
    for how in ("change", "keep"):
        m = copy.deepcopy(master)
        write_back(m, sur, "knowledge", how)
        moved[how] = m.base.state_dict()
    origin = master.base.state_dict()
    layers = {f"{n}.weight" for n in knowledge_of(master).layers}
    params = dict(master.base.named_parameters())
    moved_bn = [k for k in params if k.endswith(".bias") and k not in layers
                and not torch.equal(moved["change"][k], origin[k])]
    assert moved_bn  # the adapted surrogate changed some BN beta
    for k, v in moved["keep"].items():
        if k in layers or k not in params:  # filters in Θ*, BN buffers
            assert torch.equal(v, moved["change"][k]), k
        else:
            assert torch.equal(v, origin[k]), k
    assert any(not torch.equal(moved["keep"][k], origin[k]) for k in layers)


def test_write_back_refuses_an_unknown_mode(master) -> None:
    with pytest.raises(ValueError, match=r"master_update must be one of .*got 'half'"):
        write_back(master, adapted_surrogate(copy.deepcopy(master), 0), "half")
    with pytest.raises(ValueError, match=r"master_bn must be one of change, keep, got 'x'"):
        write_back(master, adapted_surrogate(copy.deepcopy(master), 0), "knowledge", "x")


@pytest.mark.parametrize("card", SHIPPED)
def test_shipped_cards_carry_a_tied_knowledge(card) -> None:
    """The second pre-training loss on the shipped masters is below 1e-4 (§III-B1: 'minimized
    to 0'); the r18 card stores float16 tensors, hence not 0."""
    m = load_gated(card)
    kn = knowledge_of(m)
    assert kn is not None and kn.share == 1.0
    with torch.no_grad():
        assert float(kn.tie_loss(m.base)) < 1e-4


def test_scope_all_card_carries_a_trained_rank_k_knowledge() -> None:
    """The scope-"all" card: K = N/4 relevances trained from the similarity gauge, the
    filters at rank K (tie below 1e-6 of their squared norm), w not orthonormal, so Eqs.
    3-4 are no identity update."""
    m = load_gated("checkpoints/small_resnet_signs32_all_elastic.json")
    kn = knowledge_of(m)
    assert m.scope == "all" and kn.share == 0.25
    mods = dict(m.base.named_modules())
    with torch.no_grad():
        norm = sum(float(mods[n].weight.pow(2).sum()) for n in kn.layers)
        assert float(kn.tie_loss(m.base)) < 1e-6 * norm
        for n in kn.layers:
            w = kn.relevances(n)
            assert w.shape[1] == -(-w.shape[0] // 4)
            assert float((w.t() @ w - torch.eye(w.shape[1])).abs().max()) > 0.05


def test_checkpoint_round_trip(master, tmp_path) -> None:
    m = copy.deepcopy(master)
    with torch.no_grad():
        knowledge_of(m).matrices("layer3.0.conv1").mul_(1.5)  # untied on purpose
    card = save_master(m, tmp_path / "net", load_card("checkpoints/small_resnet_signs32.json"))
    assert load_card(card).kwargs["knowledge"] == 1.0
    back = load_gated(card)
    want = m.state_dict()
    got = back.state_dict()
    assert set(got) == set(want) and any(k.startswith("knowledge.theta.") for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_checkpoint_without_knowledge_is_converted_with_one_line(caplog) -> None:
    m = randomize_gates(make_gated(small_source()), seed=3)
    assert knowledge_of(m) is None
    with caplog.at_level(logging.WARNING, logger="tta_core.elasticdnn.knowledge"):
        kn = require_knowledge(m, "the master")
    assert knowledge_of(m) is kn
    [rec] = caplog.records
    assert "\n" not in rec.getMessage()
    assert rec.getMessage().startswith("the master has no domain knowledge Θ*")
    assert "tta train-elastic --knowledge-only" in rec.getMessage()


def test_card_with_knowledge_refuses_a_checkpoint_without(master, tmp_path) -> None:
    m = copy.deepcopy(master)
    card = save_master(m, tmp_path / "net", load_card("checkpoints/small_resnet_signs32.json"))
    plain = copy.deepcopy(m)
    del plain.knowledge
    save_master(plain, tmp_path / "old", load_card("checkpoints/small_resnet_signs32.json"))
    (tmp_path / "net.safetensors").write_bytes((tmp_path / "old.safetensors").read_bytes())
    with pytest.raises(InputError, match=r"knowledge\.theta"):
        load_gated(card)


def test_pretraining_trains_knowledge_with_the_second_loss_then_reties() -> None:
    """train.py: the tie loss is added to every step (Θ* and w move with the filters, the
    filters are pulled towards their combinations: a smaller loss than without it), and
    `retie` solves Θ* so the second loss ends at float error."""
    from tta_core.elasticdnn.train import ElasticTrainConfig, _train_phases, retie

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 22, (16,), generator=gen)
    ties = {}
    for tie in (0.0, 1.0):
        torch.manual_seed(0)  # the gates' initialisation
        m = make_gated(small_source())
        kn = attach_knowledge(m)
        w0 = {n: kn.relevances(n).detach().clone() for n in kn.layers}
        cfg = ElasticTrainConfig(warmup_epochs=1, stage_epochs=1, stages=(0.5,), batch_size=8,
                                 lr=0.05, tie=tie, threads=0)
        assert _train_phases(m, x, y, cfg, progress=False) == 4
        ties[tie] = float(kn.tie_loss(m.base).detach())
        assert any(not torch.equal(kn.relevances(n), w0[n]) for n in kn.layers) == (tie > 0)
    assert 0 < ties[1.0] < 0.9 * ties[0.0]  # measured 0.41 vs 0.53 (seeds 0-2)
    assert retie(m) < 1e-9
    assert not any(p.requires_grad for p in kn.parameters())


def test_hard_tie_phase_keeps_the_filters_at_rank_k() -> None:
    """hard_tie_epochs: after every step Θ* is solved and the filters projected, so the
    second loss is float error at K = N/4 while the filters still train."""
    from tta_core.elasticdnn.train import ElasticTrainConfig, _train_phases

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 22, (16,), generator=gen)
    torch.manual_seed(0)
    m = make_gated(small_source())
    kn = attach_knowledge(m, 0.25, gauge="similarity")
    assert float(kn.tie_loss(m.base).detach()) > 1e-2  # the SVD tail
    w0 = m.base.layer2[0].conv1.weight.detach().clone()
    cfg = ElasticTrainConfig(warmup_epochs=0, stage_epochs=0, hard_tie_epochs=1, stages=(0.5,),
                             batch_size=8, lr=0.05, threads=0)
    assert _train_phases(m, x, y, cfg, progress=False) == 2
    assert float(kn.tie_loss(m.base).detach()) < 1e-8
    w = m.base.layer2[0].conv1.weight.detach()
    assert not torch.equal(w, w0)
    assert int(torch.linalg.matrix_rank(w.reshape(len(w), -1))) == kn.relevances(
        "layer2.0.conv1").shape[1]

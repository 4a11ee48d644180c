"""ElasticDNN filter-grained update (tta_core.elasticdnn.filter_update): scores from BN
gradients, mass selection (brute force), only selected filters change, write-back only at
the kept indices."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from helpers.models import randomize_gates, signs_batch, small_source

from tta_core.elasticdnn.filter_update import (
    _param_masks,
    filter_optimizer,
    filter_scores,
    im_loss,
    mask_gradients,
    select_filters,
    write_back,
)
from tta_core.elasticdnn.gates import make_gated
from tta_core.elasticdnn.surrogate import extract_surrogate, highest_entropy_sample


@pytest.fixture(scope="module")
def master():
    return randomize_gates(make_gated(small_source()), seed=2).eval()


@pytest.fixture(scope="module")
def batch():
    return signs_batch(24, seed=11)


def surrogate_of(master, batch, keep=0.5, sparsity=0.5):
    master.set_sparsity(sparsity)
    try:
        return extract_surrogate(master, highest_entropy_sample(master, batch), keep)
    finally:
        master.set_sparsity(0.0)


def test_im_loss_is_entropy_minus_marginal_entropy() -> None:
    logits = torch.tensor([[2.0, 0.0, -1.0], [0.0, 3.0, 0.0]])
    p = torch.softmax(logits, 1)
    ent = -(p * p.log()).sum(1).mean()
    pm = p.mean(0)
    assert float(im_loss(logits)) == pytest.approx(float(ent + (pm * pm.log()).sum()), abs=1e-6)
    # confident and diverse beats confident and collapsed
    assert im_loss(torch.eye(3) * 20) < im_loss(torch.tensor([[20.0, 0, 0]] * 3))


def _brute_min_count(values: list[float], need: float) -> int:
    for r in range(len(values) + 1):
        if any(sum(c) >= need for c in itertools.combinations(values, r)):
            return r
    raise AssertionError("unreachable")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mass", [0.3, 0.8, 1.0])
def test_select_filters_is_the_fewest_holding_the_mass(seed, mass) -> None:
    gen = torch.Generator().manual_seed(seed)
    scores = {"a": torch.rand(3, generator=gen), "b": torch.rand(4, generator=gen) ** 3,
              "c": torch.rand(2, generator=gen)}
    masks = select_filters(scores, mass)
    values = torch.cat(list(scores.values())).tolist()
    chosen = torch.cat(list(masks.values()))
    need = mass * sum(values)
    assert sum(v for v, c in zip(values, chosen.tolist(), strict=True) if c) >= need - 1e-9
    assert int(chosen.sum()) == _brute_min_count(values, need - 1e-9)
    assert min(v for v, c in zip(values, chosen.tolist(), strict=True) if c) >= max(
        [v for v, c in zip(values, chosen.tolist(), strict=True) if not c], default=0)
    assert {k: m.shape for k, m in masks.items()} == {k: s.shape for k, s in scores.items()}


def test_select_filters_edge_cases() -> None:
    masks = select_filters({"a": torch.zeros(3)})
    assert not masks["a"].any()
    with pytest.raises(ValueError, match="mass must be in"):
        select_filters({"a": torch.ones(2)}, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        select_filters({"a": torch.tensor([1.0, -1.0])})


def test_filter_scores_match_finite_differences(master, batch) -> None:
    sur = surrogate_of(master, batch)
    sur.model.double()
    x = batch.double()
    before = {n: b.clone() for n, b in sur.model.named_buffers()}
    scores = filter_scores(sur, x)
    assert all(torch.equal(b, before[n]) for n, b in sur.model.named_buffers())
    assert all(p.grad is None for p in sur.model.parameters())
    mods = dict(sur.model.named_modules())
    site = sur.sites[1]
    bn, eps = mods[site.bn], 1e-6

    def loss() -> float:
        sur.model.train()
        out = float(im_loss(sur.model(x)))
        for n, b in sur.model.named_buffers():
            b.copy_(before[n])
        return out

    with torch.no_grad():
        for i in range(3):
            fd = []
            for p in (bn.weight, bn.bias):
                p[i] += eps
                up = loss()
                p[i] -= 2 * eps
                down = loss()
                p[i] += eps
                fd.append(abs(up - down) / (2 * eps))
            # rel 1e-3: a ReLU kink inside +-eps moves the difference quotient by ~1e-4
            assert float(scores[site.conv][i]) == pytest.approx(sum(fd), rel=1e-3, abs=1e-8)


def _step(sur, x, opt, steps=2) -> None:
    sur.model.train()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        im_loss(sur.model(x)).backward()
        opt.step()


@pytest.mark.parametrize("make_opt", [
    lambda sur: filter_optimizer(sur, lr=0.05, momentum=0.9),
    lambda sur: torch.optim.Adam([p for p in sur.model.parameters() if p.requires_grad],
                                 lr=0.01),
])
def test_only_selected_filters_change(master, batch, make_opt) -> None:
    sur = surrogate_of(master, batch)
    masks = select_filters(filter_scores(sur, batch), 0.8)
    n_sel, n_all = sum(int(m.sum()) for m in masks.values()), sum(m.numel() for m in masks.values())
    assert 0 < n_sel < n_all
    before = {n: p.detach().clone() for n, p in sur.model.named_parameters()}
    mask_gradients(sur, masks)
    _step(sur, batch, make_opt(sur))
    pmasks = _param_masks(sur, masks)
    for name, p in sur.model.named_parameters():
        m = pmasks.get(name, torch.zeros_like(p, dtype=torch.bool))
        assert torch.equal(p.detach()[~m], before[name][~m]), name  # bit-identical
    changed = [n for n, m in pmasks.items()
               if not torch.equal(dict(sur.model.named_parameters())[n].detach()[m],
                                  before[n][m])]
    assert len(changed) >= 3  # the selected slices did train


def test_weight_decay_would_move_unselected_entries(master, batch) -> None:
    """Why filter_optimizer has no weight decay: the decay term bypasses the grad hooks."""
    sur = surrogate_of(master, batch)
    masks = select_filters(filter_scores(sur, batch), 0.5)
    before = {n: p.detach().clone() for n, p in sur.model.named_parameters()}
    mask_gradients(sur, masks)
    opt = torch.optim.SGD([p for p in sur.model.parameters() if p.requires_grad], lr=0.05,
                          weight_decay=0.1)
    _step(sur, batch, opt, 1)
    site = sur.sites[0]
    w = dict(sur.model.named_parameters())[f"{site.conv}.weight"]
    off = ~masks[site.conv]
    assert off.any() and not torch.equal(w.detach()[off], before[f"{site.conv}.weight"][off])


def _master_kept_mask(master, sur) -> dict[str, torch.Tensor]:
    """Per master tensor: the entries at kept indices (brute force over the sites)."""
    tensors = dict(master.base.named_parameters()) | dict(master.base.named_buffers())
    rows = {}
    for s in sur.sites:
        rows[s.conv] = rows[s.bn] = sur.kept[s.conv]
    out = {}
    for name in sur.origin:
        module, _, _ = name.rpartition(".")
        t = tensors[name]
        m = torch.zeros(t.shape[:2] if t.ndim > 1 else t.shape, dtype=torch.bool)
        r = rows.get(module, torch.arange(t.shape[0]))
        cols = [sur.kept[s.conv] for s in sur.sites if s.next_conv == module]
        c = cols[0] if cols and t.ndim > 1 else None
        if c is None:
            m[r] = True
        else:
            m[r[:, None], c[None, :]] = True
        out[name] = m.view(*m.shape, *([1] * (t.ndim - m.ndim))).expand_as(t)
    return out


def test_write_back_changes_only_kept_indices_by_averaging(batch) -> None:
    master = randomize_gates(make_gated(small_source()), seed=3).eval()
    x = corrupt_batch(batch)
    sur = surrogate_of(master, x, keep=0.3, sparsity=0.7)
    mask_gradients(sur, select_filters(filter_scores(sur, x), 0.8))
    _step(sur, x, filter_optimizer(sur, lr=0.05), 3)
    before = {k: v.clone() for k, v in master.state_dict().items()}
    write_back(master, sur)
    after = master.state_dict()
    kept = {f"base.{n}": m for n, m in _master_kept_mask(master, sur).items()}
    for name, value in after.items():
        m = kept.get(name, torch.zeros_like(value, dtype=torch.bool))
        assert torch.equal(value[~m], before[name][~m]), name  # bit-identical elsewhere
    # at the kept indices: the average of the master and the (unfolded) surrogate
    cur = dict(sur.model.named_parameters()) | dict(sur.model.named_buffers())
    scale = {s.bn: sur.scale[s.conv] for s in sur.sites}
    moved = 0
    for name, m in kept.items():
        base_name = name.removeprefix("base.")
        surr = cur[base_name].detach()
        module, _, kind = base_name.rpartition(".")
        if module in scale and kind in ("weight", "bias"):
            surr = surr / scale[module]  # this master's gates are all > 0 on x*
        expected = (before[name][m] + surr.reshape(-1)) / 2 if m.sum() == surr.numel() \
            else None
        assert expected is not None, name
        assert torch.allclose(after[name][m], expected, atol=1e-5), name
        moved += int((after[name][m] != before[name][m]).sum())
    assert moved > 0


def corrupt_batch(batch: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return batch + 0.5 * torch.randn(batch.shape, generator=gen)


def test_write_back_of_an_unchanged_surrogate_is_a_no_op(master, batch) -> None:
    twin = copy.deepcopy(master)
    sur = surrogate_of(twin, batch, keep=0.3, sparsity=0.7)
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    write_back(twin, sur)
    assert all(torch.equal(v, before[k]) for k, v in twin.state_dict().items())

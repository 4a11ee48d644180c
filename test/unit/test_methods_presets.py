"""Baselines at their published settings: tent's defaults are the Tent paper's algorithm
(one forward + backward, Adam on the BN affine at CIFAR scale, the pre-update prediction),
each gradient baseline's optimizer preset follows the input scale, explicit options win."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from tta_core.model.zoo import build_model
from tta_core.registry import build_method

SMALL, LARGE = (3, 32, 32), (3, 224, 224)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return build_model("small_resnet", 10)


def _batches(n: int, size: int = 32, batch: int = 8) -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 3, size, size, generator=g) * (1 + 0.5 * i) for i in range(n)]


def _reference_tent(model: nn.Module, xs: list[Tensor]) -> list[Tensor]:
    """Tent as its paper and code (DequanWang/tent) do it, written here: BN on batch
    statistics, only the BN affine trains, Adam 1e-3, one step per batch on the mean
    entropy, the pre-update logits returned."""
    model.train().requires_grad_(False)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.requires_grad_(True)
            m.track_running_stats, m.running_mean, m.running_var = False, None, None
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                           betas=(0.9, 0.999))
    outs = []
    for x in xs:
        out = model(x)
        (-(out.softmax(1) * out.log_softmax(1)).sum(1).mean()).backward()
        opt.step()
        opt.zero_grad()
        outs.append(out.detach())
    return outs


def test_tent_defaults_are_the_papers_tent() -> None:
    xs = _batches(3, batch=4)
    ref_model, model = _model(), _model()
    ref = _reference_tent(ref_model, xs)
    meth = build_method("tent", model, input_shape=SMALL, memory_format="contiguous")
    for x, r in zip(xs, ref, strict=True):
        torch.testing.assert_close(meth.step(x).logits, r, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


# (method, input shape): optimizer, momentum, nesterov, lr at batch 4 / 16 / 64 / 128,
# method fields the preset fills
PRESETS = {
    ("tent", SMALL): ("Adam", None, None, [1e-3] * 4, {}),
    ("tent", LARGE): ("SGD", 0.9, True, [2.5e-4 * b / 64 for b in (4, 16, 64, 128)], {}),
    ("eata", SMALL): ("Adam", None, None, [1e-3] * 4, {"fisher_alpha": 1.0}),
    ("eata", LARGE): ("SGD", 0.9, False, [2.5e-4 * b / 64 for b in (4, 16, 64, 128)],
                      {"fisher_alpha": 2000.0}),
    ("sar", SMALL): ("SGD", 0.9, False, [1e-3] * 4, {}),
    ("sar", LARGE): ("SGD", 0.9, False, [2.5e-4 / 8, 2.5e-4 / 2, 2.5e-4, 2.5e-4], {}),
    ("cotta", SMALL): ("Adam", None, None, [1e-3] * 4,
                       {"restore_prob": 0.01, "anchor_threshold": 0.92}),
    ("cotta", LARGE): ("SGD", 0.9, True, [0.01] * 4,
                       {"restore_prob": 0.001, "anchor_threshold": 0.1}),
}


@pytest.mark.parametrize("name,shape", list(PRESETS))
def test_presets_follow_the_input_scale(name: str, shape: tuple[int, ...]) -> None:
    opt, momentum, nesterov, lrs, fields = PRESETS[name, shape]
    meth = build_method(name, _model(), input_shape=shape, memory_format="contiguous")
    group = meth.optimizer.param_groups[0]
    assert type(meth.optimizer).__name__ == opt
    if opt == "SGD":
        assert (group["momentum"], group["nesterov"]) == (momentum, nesterov)
    else:
        assert group["betas"] == (0.9, 0.999)
    assert [meth.effective_lr(b) for b in (4, 16, 64, 128)] == pytest.approx(lrs)
    assert {k: getattr(meth.config, k) for k in fields} == fields


def test_explicit_options_override_the_preset() -> None:
    big = build_method("tent", _model(), input_shape=LARGE, memory_format="contiguous",
                       lr=0.01, momentum=0.5)
    assert big.effective_lr(64) == pytest.approx(0.01) and big.effective_lr(16) == 0.0025
    assert big.optimizer.param_groups[0]["momentum"] == 0.5
    sgd = build_method("tent", _model(), input_shape=SMALL, memory_format="contiguous",
                       optimizer="sgd")
    assert type(sgd.optimizer).__name__ == "SGD" and sgd.effective_lr(4) == 1e-3
    sar = build_method("sar", _model(), input_shape=LARGE, memory_format="contiguous",
                       lr_ref_batch=64)  # a user's ref batch: linear, no cap
    assert sar.effective_lr(128) == pytest.approx(5e-4)
    cotta = build_method("cotta", _model(), input_shape=SMALL, memory_format="contiguous",
                         restore_prob=0.0)
    assert cotta.config.restore_prob == 0.0 and cotta.config.anchor_threshold == 0.92


def test_without_input_shape_the_first_batch_sets_the_scale() -> None:
    """No input_shape: the first batch (72 px: ImageNet scale) picks the preset, and the
    run equals one built with the shape, through a reset too."""
    xs = _batches(2, size=72, batch=2)
    known = build_method("tent", _model(), input_shape=(3, 72, 72), memory_format="contiguous")
    lazy = build_method("tent", _model(), memory_format="contiguous")
    assert type(lazy.optimizer).__name__ == "Adam"  # provisional, before any step
    first = [lazy.step(x).logits for x in xs]
    assert type(lazy.optimizer).__name__ == "SGD" and lazy.config.lr == 2.5e-4
    for x, a in zip(xs, first, strict=True):
        assert torch.equal(known.step(x).logits, a)
    lazy.reset()
    assert all(torch.equal(lazy.step(x).logits, a) for x, a in zip(xs, first, strict=True))


@pytest.mark.parametrize("bad", [{"optimizer": "rmsprop"}, {"scale": "huge"}])
def test_bad_optimizer_or_scale_is_refused_in_one_line(bad: dict) -> None:
    with pytest.raises(ValueError) as err:
        build_method("tent", _model(), **bad)
    assert repr(next(iter(bad.values()))) in str(err.value) and "\n" not in str(err.value)

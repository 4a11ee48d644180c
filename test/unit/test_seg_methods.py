"""Every method of `tta bench --task segmentation` on the shipped LR-ASPP card: it builds
with the bench's segmentation settings, steps 2 batches of 2 rendered scenes at 64 x 128,
returns N x C x H x W logits and changes the weights it adapts (and only the adapting
methods do); the others refuse in one line naming the method and why. Plus the per-pixel
pieces: EATA's pixel filters, CoTTA's aligned scale/flip average and SURGEON's cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.scenes import render_scene
from tta_core.errors import InputError
from tta_core.eval.seg_bench import (
    SEG_METHODS,
    SegBenchConfig,
    check_methods,
    method_options,
)
from tta_core.methods.cotta import scale_flip_probs
from tta_core.model.source import load_source
from tta_core.registry import available_methods, build_method
from tta_core.runtime.losses import pixel_rows, softmax_entropy

CARD = Path(__file__).resolve().parents[2] / "checkpoints" / "lraspp_mobilenet_v3_large_scenes.json"
ADAPTING = ("tent", "eata", "sar", "cotta", "surgeon", "adashadow")
# adashadow's plans depend on measured times: at sigma 1 a plan fits on any machine
UNTIMED = {"adashadow": {"sigma": 1.0}}
FAST = {"memory_format": "contiguous"}  # no layout timing at build


@pytest.fixture(scope="module")
def batches() -> list[torch.Tensor]:
    """Two batches of two rendered driving scenes at 64 x 128, normalised as the card."""
    _, card = load_source(CARD)
    imgs = np.stack([render_scene((7, 0, i)).image for i in range(4)])
    x = images_to_tensor(imgs, card.mean, card.std)
    x = torch.nn.functional.interpolate(x, size=(64, 128), mode="bilinear",
                                        align_corners=False)
    return [x[:2], x[2:]]


@pytest.mark.parametrize("name", SEG_METHODS)
def test_each_seg_method_steps_and_adapts_where_it_should(name, batches, one_thread):
    torch.manual_seed(0)
    model, card = load_source(CARD)
    cfg = SegBenchConfig(model_card=CARD, data="acdc:unused")
    meth = build_method(name, model, **method_options(name, cfg, card), **FAST,
                        **UNTIMED.get(name, {}))
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    for x in batches:
        res = meth.step(x)
        assert res.logits.shape == (2, card.num_classes, 64, 128)
        assert bool(torch.isfinite(res.logits).all())
    moved = [k for k, v in model.named_parameters() if not torch.equal(v, before[k])]
    if name in ADAPTING:
        assert moved, f"{name} changed no parameter in two steps"
        assert res.adapted
    else:
        assert not moved


def test_tent_segmentation_rate_moves_the_norms_where_the_imagenet_preset_does_not(
        batches, one_thread):
    """The imagenet preset scaled to batch 2 (SGD 2.5e-4 x 2/64) moves the norm weights
    by < 1e-4 in two steps; the ACDC setting (Adam 6e-5 x 2/8) by > 100 times more."""
    change = {}
    for label, opts in (("imagenet", {}), ("acdc", None)):
        model, card = load_source(CARD)
        if opts is None:
            opts = method_options("tent", SegBenchConfig(model_card=CARD, data="x"), card)
        meth = build_method("tent", model, input_shape=(3, *card.input_hw), **FAST,
                            **{k: v for k, v in opts.items() if k != "input_shape"})
        p0 = [p.detach().clone() for p in meth.params]
        for x in batches:
            meth.step(x)
        change[label] = float(sum((p.detach() - q).abs().sum()
                                  for p, q in zip(meth.params, p0, strict=True)))
    assert change["imagenet"] < 1e-2 * change["acdc"]


def test_methods_that_cannot_segment_refuse_in_one_line():
    for name in sorted(set(available_methods()) - set(SEG_METHODS)):
        with pytest.raises(InputError) as exc:
            check_methods((name,))
        text = str(exc.value)
        assert "\n" not in text and f"'{name}' does not support segmentation: " in text
    with pytest.raises(InputError, match="classifier-output method"):
        check_methods(("source", "lame"))


def test_a_variant_label_is_its_methods_with_its_own_options():
    """`adashadow@per_batch` (tta sweep and --set's variants) segments as adashadow with
    its own options, over the segmentation settings of its method; `lame@x` refuses as
    lame does."""
    check_methods(("adashadow@per_batch", "tent@slow"))
    with pytest.raises(InputError, match="'lame' does not support segmentation"):
        check_methods(("lame@x",))
    _, card = load_source(CARD)
    cfg = SegBenchConfig(model_card=CARD, data="x", method_options={
        "tent@slow": {"lr": 1e-6}, "adashadow@per_batch": {"bn_momentum_batch": 0}})
    plain, slow = (method_options(n, cfg, card) for n in ("tent", "tent@slow"))
    assert slow == {**plain, "lr": 1e-6} and plain["lr"] != 1e-6
    ada = method_options("adashadow@per_batch", cfg, card)
    assert ada["bn_momentum_batch"] == 0 and ada["input_shape"] == (3, *card.input_hw)
    assert "bn_momentum_batch" not in method_options("adashadow", cfg, card)


def test_eata_filters_pixels_not_images():
    """A batch whose one image is half confident, half uniform: EATA uses the confident
    pixels of that image only (per-pixel entropy filter), weights them per pixel."""
    model, _ = load_source(CARD)
    eata = build_method("eata", model, input_shape=(3, 64, 128), **FAST)
    logits = torch.zeros(2, 19, 4, 4)
    logits[0, 3, :2] = 20.0  # rows 0-1 of image 0: confident class 3
    sel = eata.select(logits)
    assert sel.used.shape == (2, 4, 4)
    assert bool(sel.used[0, :2].all()) and not bool(sel.used[0, 2:].any())
    assert not bool(sel.used[1].any())
    ent = softmax_entropy(logits)
    assert torch.allclose(sel.weight[0, :2], torch.exp(eata.e_margin(19) - ent[0, :2]))
    eata._update_probs(logits, sel.used)
    assert int(eata.model_probs.argmax()) == 3
    rows = pixel_rows(logits)
    assert torch.equal(rows[5], logits[0, :, 1, 1])  # row n*H*W + h*W + w


def test_cotta_scale_flip_average_stays_aligned_with_the_pixels():
    """An identity 'net' (logits = the input): every scaled, flipped copy maps back to
    the same pixel, so the average equals the single prediction (an uninverted flip or
    a shift would not)."""
    class Identity(torch.nn.Module):
        def forward(self, x):
            return x

    x = torch.randn(1, 3, 8, 16, generator=torch.Generator().manual_seed(0))
    avg = scale_flip_probs(Identity(), x, (1.0,), True)
    assert torch.allclose(avg, x.softmax(1), atol=1e-6)
    ramp = torch.linspace(0, 1, 16).expand(1, 3, 8, 16).clone()
    ramp[:, 1] = 1 - ramp[:, 1]
    multi = scale_flip_probs(Identity(), ramp, (0.5, 1.0, 2.0), True)
    assert torch.allclose(multi, ramp.softmax(1), atol=0.02)
    unflipped_mirror = ramp.flip(3).softmax(1)
    assert not torch.allclose(multi, unflipped_mirror, atol=0.02)


def test_surgeon_caches_under_half_of_tent_on_the_card(batches, one_thread):
    """Measured saved bytes of one update (eval.saved_memory's meter): SURGEON's pruned
    all-layer update stores less than Tent's dense norm-layer one at 64 x 128."""
    from tta_core.eval.saved_memory import ActivationMeter

    cache = {}
    for name in ("tent", "surgeon"):
        model, card = load_source(CARD)
        meth = build_method(name, model, **FAST, **method_options(
            name, SegBenchConfig(model_card=CARD, data="x"), card))
        meter = ActivationMeter(model, True)
        with meter.step():
            res = meth.step(batches[0])
        meter.note(res.stats)
        cache[name] = meter.memory.totals()[0]
    assert 0 < cache["surgeon"] < 0.5 * cache["tent"]

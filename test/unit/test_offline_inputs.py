"""The offline phases' inputs from a user's clean labelled images
(tta_core.data.sources.load_labelled, training_corruptions; tta_core.cli.offline_inputs):
classes matched to the card's by name, disjoint fitting and held-out images, labelled
corrupted images from the corruption library, held-out corruptions never used."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tta_core.cli import offline_args
from tta_core.cli.offline_inputs import darda_data, elastic_data, encoder_data
from tta_core.data.corruptions import HELD_OUT, corrupt_batch
from tta_core.data.sources import load_labelled, training_corruptions
from tta_core.errors import InputError
from tta_core.model.source import ModelCard

NAMES = ["stop", "yield", "ahead"]


def _card(names=NAMES) -> ModelCard:
    return ModelCard(arch="x", num_classes=len(names), class_names=list(names), image_size=16,
                     mean=[0.0] * 3, std=[1.0] * 3, checkpoint="w.pt")


def _folder(root, per_class: int = 4, classes=("ahead", "stop", "yield")) -> None:
    rng = np.random.default_rng(0)
    for c in classes:
        (root / "clean" / c).mkdir(parents=True)
        for i in range(per_class):
            # the class in the red channel: a label mix-up shows in the pixels
            im = rng.integers(0, 50, (20, 20, 3), dtype=np.uint8)
            im[..., 0] = 40 * [*NAMES, "zebra"].index(c) + 10
            Image.fromarray(im).save(root / "clean" / c / f"{i}.png")


def test_the_held_out_copy_is_the_corruption_librarys() -> None:
    assert offline_args.HELD_OUT == HELD_OUT


def test_folder_classes_are_matched_to_the_card_by_name(tmp_path) -> None:
    _folder(tmp_path)
    li = load_labelled(f"folder:{tmp_path}", 16, NAMES)
    assert li.images.shape == (12, 16, 16, 3) and li.class_names == tuple(NAMES)
    # sorted folder order is ahead, stop, yield; the card's is stop, yield, ahead
    red = li.images[..., 0].mean(axis=(1, 2))
    for y, r in zip(li.labels, red, strict=True):
        assert abs(r - (40 * int(y) + 10)) < 2, (y, r)


def test_a_class_the_card_lacks_is_refused_in_one_line(tmp_path) -> None:
    _folder(tmp_path, classes=("ahead", "stop", "yield", "zebra"))
    with pytest.raises(InputError, match="zebra") as info:
        load_labelled(f"folder:{tmp_path}", 16, NAMES)
    assert "\n" not in str(info.value)


def test_a_corruption_release_without_clean_images_is_refused(tmp_path) -> None:
    np.save(tmp_path / "fog.npy", np.zeros((5, 8, 8, 3), np.uint8))
    with pytest.raises(InputError, match=r"train\.npy"):
        load_labelled(f"cifar10c:{tmp_path}", 16, NAMES)


def test_training_corruptions_leave_the_held_out_ones_out() -> None:
    assert not set(training_corruptions()) & set(HELD_OUT)
    assert len(training_corruptions()) == 15
    assert training_corruptions(("fog", "snow", "frost"), ("snow",)) == ("fog", "frost")
    with pytest.raises(ValueError, match="leave 1"):
        training_corruptions(("fog", "snow"), ("snow",))
    with pytest.raises(ValueError, match="unknown corruption 'mist'"):
        training_corruptions(("fog", "mist"))


def test_darda_images_are_disjoint_and_corrupted_by_the_library(tmp_path) -> None:
    _folder(tmp_path, per_class=6)
    li = load_labelled(f"folder:{tmp_path}", 16, NAMES)
    card = _card()
    corr = ("contrast", "pixelate")
    data = darda_data(li, corr, samples=8, eval_samples=4, severity=3, seed=5, card=card)
    assert torch.equal(data.train.d, torch.tensor([0] * 8 + [1] * 8))
    assert torch.equal(data.held.d, torch.tensor([0] * 4 + [1] * 4))
    fit, held = li.split(4, 5)
    assert not {im.tobytes() for im in fit.images} & {im.tobytes() for im in held.images}
    want = corrupt_batch(fit.images[:8], "pixelate", 3, 5).astype(np.float32) / 255
    got = data.train.x[8:].permute(0, 2, 3, 1).numpy()
    assert np.allclose(got, want, atol=1e-6)
    assert torch.equal(data.train.y[:8], torch.as_tensor(fit.labels[:8]))


def test_elastic_sees_every_image_clean_and_under_one_corruption(tmp_path) -> None:
    _folder(tmp_path, per_class=5)
    li = load_labelled(f"folder:{tmp_path}", 16, NAMES)
    data = elastic_data(li, ("contrast", "pixelate"), 5, val=3, seed=0, card=_card())
    fit, held = li.split(3, 0)
    n = len(fit.labels)
    assert len(data.x) == 2 * n and len(data.val_x) == 3
    assert torch.equal(data.y[:n], data.y[n:])
    clean = fit.images.astype(np.float32) / 255
    assert np.allclose(data.x[:n].permute(0, 2, 3, 1).numpy(), clean, atol=1e-6)
    second = corrupt_batch(fit.images[1::2], "pixelate", 5, 1).astype(np.float32) / 255
    assert np.allclose(data.x[n + 1::2].permute(0, 2, 3, 1).numpy(), second, atol=1e-6)
    assert np.allclose(data.val_x.permute(0, 2, 3, 1).numpy(),
                       held.images.astype(np.float32) / 255, atol=1e-6)


def test_the_encoder_learns_corruptions_not_classes(tmp_path) -> None:
    _folder(tmp_path)
    li = load_labelled(f"folder:{tmp_path}", 16, NAMES)
    x, y = encoder_data(li, ("contrast", "pixelate", "brightness"), 5, 2, 0, _card())
    assert x.shape == (15, 3, 16, 16)
    assert torch.equal(y, torch.tensor([0] * 5 + [1] * 5 + [2] * 5))


def test_the_bench_reads_a_folders_classes_by_the_cards_names(tmp_path) -> None:
    """`tta bench --data folder:DIR` labels each frame with the card's index of its class
    folder's name (the folder's sorted names are not the card's order)."""
    from tta_core.eval.bench_config import BenchConfig
    from tta_core.eval.bench_inputs import bench_inputs
    from tta_core.model.source import load_card

    card_path = "checkpoints/small_resnet_signs32.json"
    card = load_card(card_path)
    names = list(card.class_names)
    assert sorted(names) != names  # else the test could not tell names from positions
    rng, step = np.random.default_rng(0), 250 // len(names)
    for k, c in enumerate(names):
        (tmp_path / "fog" / c).mkdir(parents=True)
        im = rng.integers(0, 50, (32, 32, 3), dtype=np.uint8)
        im[..., 0] = step * k + 2  # the card's index of the class, in the red channel
        Image.fromarray(im).save(tmp_path / "fog" / c / "0.png")
    cfg = BenchConfig(data=f"folder:{tmp_path}", model_card=card_path, batch_size=4)
    _, _, batches = bench_inputs(cfg)
    seen = []
    for b in batches:
        red = (b.x[:, 0, 0, 0] * card.std[0] + card.mean[0]) * 255
        seen += list(zip(torch.round((red - 2) / step).long().tolist(), b.labels.tolist(),
                         strict=True))
    assert len(seen) == len(names)
    assert all(k == label for k, label in seen), seen

"""Synthetic signs, corruptions, shift-stream orders and the real-data loaders."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from tta_core.data.corruptions import CORRUPTIONS, SEVERITIES, corrupt_batch, corrupt_image
from tta_core.data.loaders import load_cifar10c, load_image_folder
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import CLASS_NAMES, make_signs
from tta_core.data.streams import (
    GRADUAL_LEVELS,
    StreamSpec,
    build_stream,
    dirichlet_labels,
)


def test_signs_are_deterministic_balanced_and_varied():
    a, b = make_signs(66, 32, seed=3), make_signs(66, 32, seed=3)
    assert np.array_equal(a.images, b.images) and np.array_equal(a.labels, b.labels)
    assert not np.array_equal(a.images, make_signs(66, 32, seed=4).images)
    assert len(CLASS_NAMES) >= 16
    counts = np.bincount(a.labels, minlength=len(CLASS_NAMES))
    assert counts.max() - counts.min() <= 1
    same = a.images[a.labels == 0].astype(int)
    assert np.abs(same[0] - same[1]).mean() > 10  # random pose/background per image
    assert make_signs(4, 64, seed=0).images.shape == (4, 64, 64, 3)


@pytest.mark.parametrize("name", [pytest.param(c, marks=pytest.mark.slow) if c == "glass_blur"
                                  else c for c in CORRUPTIONS])
def test_each_corruption_each_severity_keeps_shape_dtype(name):
    img = make_signs(1, 32, seed=0).images[0]
    outs = [corrupt_image(img, name, s, seed=7) for s in SEVERITIES]
    for out in outs:
        assert out.shape == img.shape and out.dtype == np.uint8
    assert any(not np.array_equal(o, img) for o in outs)
    assert np.array_equal(outs[-1], corrupt_image(img, name, 5, seed=7))  # deterministic


def test_corruption_bad_input_is_named():
    img = np.zeros((32, 32, 3), np.uint8)
    with pytest.raises(ValueError, match="'rain'"):
        corrupt_image(img, "rain", 3)
    with pytest.raises(ValueError, match=r"severity must be 1\.\.5, got 6"):
        corrupt_image(img, "fog", 6)
    with pytest.raises(ValueError, match="uint8"):
        corrupt_image(img.astype(np.float32), "fog", 1)
    # image by image, each with its own seed: two copies of a frame get different noise,
    # the same seed the same noise again, another seed other noise
    grey = np.full((2, 32, 32, 3), 128, np.uint8)
    out = corrupt_batch(grey, "gaussian_noise", 2, seed=1)
    assert out.shape == grey.shape and out.dtype == np.uint8
    assert not np.array_equal(out[0], grey[0]) and not np.array_equal(out[0], out[1])
    assert np.array_equal(out, corrupt_batch(grey, "gaussian_noise", 2, seed=1))
    assert not np.array_equal(out, corrupt_batch(grey, "gaussian_noise", 2, seed=2))


def _spec(**kw) -> StreamSpec:
    base = dict(samples_per_domain=4, corruptions=("fog", "contrast", "pixelate"), seed=1)
    base.update(kw)
    return StreamSpec(**base)


def test_continual_stream_follows_order_and_is_deterministic():
    s1, s2 = build_stream(_spec()), build_stream(_spec())
    assert s1.domain_order() == ["fog/5", "contrast/5", "pixelate/5"]
    assert np.array_equal(s1.images, s2.images)
    assert [b.domain for b in s1.batches(4)] == ["fog/5", "contrast/5", "pixelate/5"]


def test_gradual_goes_up_then_down_per_corruption():
    s = build_stream(_spec(order="gradual", samples_per_domain=9, corruptions=("fog",)))
    runs = [d for i, d in enumerate(s.domains) if i == 0 or d != s.domains[i - 1]]
    sev = [int(d.split("/")[1]) for d in runs]
    assert sev == list(GRADUAL_LEVELS) and sev.index(5) == 4


def test_recurring_repeats_the_sequence_with_fresh_images():
    s = build_stream(_spec(order="recurring", recurrences=3))
    order = [d for d, _ in zip(s.domains[::4], range(99), strict=False)]
    assert order == ["fog/5", "contrast/5", "pixelate/5"] * 3
    assert not np.array_equal(s.images[:4], s.images[12:16])


def test_mixed_shuffles_domains_per_sample():
    s = build_stream(_spec(order="mixed", samples_per_domain=8))
    changes = int((s.domains[1:] != s.domains[:-1]).sum())
    assert changes > 8 and sorted(set(s.domains)) == ["contrast/5", "fog/5", "pixelate/5"]


def test_dirichlet_labels_are_temporally_correlated():
    rng = np.random.default_rng(0)
    lab = dirichlet_labels(400, 10, alpha=0.1, slots=10, rng=rng)
    iid = np.random.default_rng(1).permutation(lab)
    same_next = (lab[1:] == lab[:-1]).mean()
    assert same_next > 2 * (iid[1:] == iid[:-1]).mean()
    assert np.array_equal(np.bincount(lab), np.bincount(iid))  # same label multiset


def test_stream_spec_errors_name_the_value():
    with pytest.raises(ValueError, match="'sideways'"):
        build_stream(_spec(order="sideways"))
    with pytest.raises(ValueError, match="samples_per_domain"):
        build_stream(_spec(samples_per_domain=0))


def test_images_to_tensor_normalises():
    imgs = np.full((2, 4, 4, 3), 255, np.uint8)
    x = images_to_tensor(imgs, (0.5, 0.5, 0.5), (0.25, 0.5, 1.0))
    assert x.shape == (2, 3, 4, 4)
    assert x[0, :, 0, 0].tolist() == [2.0, 1.0, 0.5]


def test_cifar10c_seeds_draw_different_rows_of_the_severity(tmp_path):
    """Seed 0: each corruption's first rows (the published stream); seeds 1 and 2: rows
    drawn at random from that severity only, different per seed, reproducible."""
    n = 40
    np.save(tmp_path / "labels.npy", np.arange(5 * n) % 10)
    for name in ("fog", "snow"):
        arr = np.zeros((5 * n, 32, 32, 3), np.uint8)
        arr[:, 0, 0, 0] = np.repeat(np.arange(1, 6), n)  # severity marker
        arr[:, 0, 0, 1] = np.tile(np.arange(n), 5)  # row within the severity
        np.save(tmp_path / f"{name}.npy", arr)

    def rows(seed: int) -> list[int]:
        s = load_cifar10c(tmp_path, ("fog", "snow"), 3, samples_per_domain=8, seed=seed)
        assert set(s.images[:, 0, 0, 0].tolist()) == {3} and s.seed == seed
        assert s.domain_order() == ["fog/3", "snow/3"] and len(s) == 16
        return s.images[:, 0, 0, 1].tolist()

    assert rows(0) == list(range(8)) * 2
    assert rows(1) == rows(1) and rows(1) != rows(2) and rows(1) != rows(0)
    assert len(set(rows(1)[:8])) == 8  # no row twice within a corruption


def test_cifar10c_loader_reads_the_public_layout(tmp_path):
    n = 6  # rows per severity (the release has 10000)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 5 * n)
    np.save(tmp_path / "labels.npy", labels)
    for name in ("fog", "snow"):
        arr = np.zeros((5 * n, 32, 32, 3), np.uint8)
        arr[:, 0, 0, 0] = np.repeat(np.arange(1, 6), n)  # severity marker
        np.save(tmp_path / f"{name}.npy", arr)
    s = load_cifar10c(tmp_path, corruptions=("fog", "snow"), severity=4, samples_per_domain=5)
    assert len(s) == 10 and s.domain_order() == ["fog/4", "snow/4"]
    assert set(s.images[:, 0, 0, 0].tolist()) == {4}
    assert np.array_equal(s.labels[:5], labels[3 * n:3 * n + 5])
    with pytest.raises(FileNotFoundError, match=r"frost\.npy"):
        load_cifar10c(tmp_path, corruptions=("frost",))
    np.save(tmp_path / "bad.npy", np.zeros((7, 32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="unknown corruption 'bad'"):
        load_cifar10c(tmp_path, corruptions=("bad",))
    np.save(tmp_path / "snow.npy", np.zeros((5 * n + 1, 32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match=r"31 rows and labels\.npy 30"):
        load_cifar10c(tmp_path, corruptions=("snow",))
    np.save(tmp_path / "fog.npy", np.zeros((5 * n, 16, 16, 3), np.uint8))
    with pytest.raises(ValueError, match=r"fog.npy has shape \(30, 16, 16, 3\)"):
        load_cifar10c(tmp_path, corruptions=("fog",))


def test_image_folder_loader(tmp_path):
    for d, colour in (("outdoor", 10), ("dim", 200)):
        for c in ("cat", "dog"):
            (tmp_path / d / c).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (20, 12), (colour, i, 0)).save(tmp_path / d / c / f"{i}.png")
    s = load_image_folder(tmp_path, domains=["outdoor", "dim"], image_size=8)
    assert s.class_names == ("cat", "dog") and s.images.shape == (8, 8, 8, 3)
    assert s.domain_order() == ["outdoor", "dim"]
    assert set(s.images[s.domains == "dim"][:, 0, 0, 0].tolist()) == {200}
    assert sorted(s.labels[:4].tolist()) == [0, 0, 1, 1]
    with pytest.raises(FileNotFoundError, match="rock"):
        load_image_folder(tmp_path, domains=["rock"])

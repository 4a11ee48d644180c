"""The CIFAR-scale benchmark generator: layout, determinism across process splits, resume,
integrity checks; the harder sign style; training on its folder, resumed after a stop."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tta_core.data import benchmark as bm
from tta_core.data.corruptions import ALL_CORRUPTIONS, HELD_OUT
from tta_core.data.signs import (
    BENCHMARK_STYLE,
    CLASS_NAMES,
    DEFAULT_STYLE,
    SignStyle,
    make_signs,
    render_sign,
)
from tta_core.data.sources import load_data, parse_data

SMALL = bm.BenchmarkConfig(train=60, test=40, per_corruption=12, seed=5,
                           corruptions=("fog", "contrast", "speckle_noise"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bench") / "signs"
    bm.generate(root, SMALL, workers=1, progress=False)
    return root


def test_layout_is_cifar10c_and_loads_through_data_kind(folder):
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(["contrast.npy", "fog.npy", "speckle_noise.npy", "labels.npy",
                            "meta.json", "test.npy", "test_labels.npy", "train.npy",
                            "train_labels.npy"])
    fog = np.load(folder / "fog.npy")
    assert fog.shape == (5 * 12, 32, 32, 3) and fog.dtype == np.uint8
    test, labels = np.load(folder / "test.npy"), np.load(folder / "test_labels.npy")
    np.testing.assert_array_equal(np.load(folder / "labels.npy"), np.tile(labels[:12], 5))
    # severity blocks: severity 5 of fog moves the clean images further than severity 1
    d1 = np.abs(fog[:12].astype(int) - test[:12]).mean()
    d5 = np.abs(fog[48:].astype(int) - test[:12]).mean()
    assert d5 > d1 > 0
    stream = load_data(parse_data(f"cifar10c:{folder}"), 32, severity=5)
    assert stream.class_names == CLASS_NAMES  # from meta.json, not CIFAR-10's
    assert list(dict.fromkeys(stream.domains.tolist())) == ["fog/5", "contrast/5"]
    np.testing.assert_array_equal(stream.images[:12], fog[48:])


def test_bytes_do_not_depend_on_the_split_over_processes(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "CHUNK", 7)  # other chunk boundaries, two processes
    bm.generate(tmp_path / "b", SMALL, workers=2, progress=False)
    assert bm.fingerprint(tmp_path / "b") == bm.fingerprint(folder)
    for name in ("train.npy", "fog.npy", "speckle_noise.npy"):
        np.testing.assert_array_equal(np.load(tmp_path / "b" / name), np.load(folder / name))


def test_a_stopped_run_resumes_to_the_same_bytes(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(bm, "CHUNK", 10)
    made = []
    real = bm._work

    def stop_after_three(root, chunk, cfg):
        if len(made) == 3:
            raise KeyboardInterrupt
        made.append(chunk)
        return real(root, chunk, cfg)

    monkeypatch.setattr(bm, "_work", stop_after_three)
    with pytest.raises(KeyboardInterrupt):
        bm.generate(tmp_path / "r", SMALL, workers=1, progress=False)
    parts = sorted(p.name for p in (tmp_path / "r" / bm.PARTS).iterdir())
    assert not (tmp_path / "r" / "train.npy").exists()  # never a short file under its name
    assert len([p for p in parts if p.endswith(".npy")]) == 3
    monkeypatch.setattr(bm, "_work", real)
    report = bm.generate(tmp_path / "r", SMALL, workers=1, progress=False)
    assert bm.fingerprint(tmp_path / "r") == bm.fingerprint(folder)
    again = bm.generate(tmp_path / "r", SMALL, workers=1, progress=False)
    assert "train.npy" in report.made and again.made == [] and "fog.npy" in again.kept


def test_verify_names_a_changed_file_and_other_configs_are_refused(folder, tmp_path):
    assert bm.verify(folder) == []
    copy = tmp_path / "c"
    copy.mkdir()
    for p in folder.iterdir():
        copy.joinpath(p.name).write_bytes(p.read_bytes())
    arr = np.load(copy / "contrast.npy")
    arr[0, 0, 0, 0] ^= 1
    np.save(copy / "contrast.npy", arr)
    assert bm.verify(copy) == ["contrast.npy"]
    with pytest.raises(ValueError, match="another config"):
        bm.generate(copy, bm.BenchmarkConfig(train=61, test=40, per_corruption=12, seed=5,
                                             corruptions=SMALL.corruptions), progress=False)


@pytest.mark.parametrize(("field", "value", "match"), [
    ("train", 0, "train must be >= 1, got 0"),
    ("per_corruption", 50, "per_corruption 50 exceeds the 40"),
    ("corruptions", ("fog", "rain"), r"corruptions \['rain'\]"),
])
def test_bad_config_is_named(field, value, match):
    cfg = bm.BenchmarkConfig(**{**vars(SMALL), field: value})
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_default_set_is_the_fifteen_and_the_held_out_four():
    assert bm.BenchmarkConfig().corruptions == ALL_CORRUPTIONS
    assert set(HELD_OUT) <= set(ALL_CORRUPTIONS) and len(ALL_CORRUPTIONS) == 19


def _nearest_mean_accuracy(style: SignStyle) -> float:
    """Accuracy of a nearest-class-mean classifier on standardised raw pixels."""
    def flat(images: np.ndarray) -> np.ndarray:
        x = images.reshape(len(images), -1).astype(float)
        x -= x.mean(1, keepdims=True)
        return x / (x.std(1, keepdims=True) + 1e-6)

    train, test = make_signs(660, 32, seed=1, style=style), make_signs(220, 32, seed=2,
                                                                        style=style)
    x = flat(train.images)
    means = np.stack([x[train.labels == k].mean(0) for k in range(len(CLASS_NAMES))])
    return float((np.argmax(flat(test.images) @ means.T, 1) == test.labels).mean())


def test_benchmark_style_is_harder_and_leaves_the_default_style_alone():
    """The benchmark style's images are further from their class template (a nearest-mean
    classifier on pixels does clearly worse on them); the default style draws none of the
    extras (an occluder size it never uses changes no byte)."""
    assert _nearest_mean_accuracy(BENCHMARK_STYLE) < 0.7 * _nearest_mean_accuracy(DEFAULT_STYLE)
    plain = SignStyle(**{**vars(DEFAULT_STYLE), "occlusion_size": (0.9, 1.0)})
    rng = [np.random.default_rng([9, 0]) for _ in range(2)]
    np.testing.assert_array_equal(render_sign(3, rng[0], 32, plain),
                                  render_sign(3, rng[1], 32, DEFAULT_STYLE))
    with pytest.raises(ValueError, match="shadow is a probability"):
        SignStyle(shadow=1.5)


def test_training_on_the_folder_resumes_bit_for_bit_after_a_stop(folder, tmp_path,
                                                                monkeypatch):
    from tta_core.model import source

    cfg = source.TrainConfig(epochs=3, batch_size=20, lr=0.05, seed=1, threads=1,
                             train_samples=0, val_samples=0, data=f"cifar10c:{folder}")
    whole = source.train_source(cfg, tmp_path / "whole", progress=False)
    real = source._save_state

    def stop_after_two(path, cfg_, epoch, *rest):
        real(path, cfg_, epoch, *rest)
        if epoch == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(source, "_save_state", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        source.train_source(cfg, tmp_path / "part", progress=False)
    assert source.train_state_path(tmp_path / "part").is_file()
    monkeypatch.setattr(source, "_save_state", real)
    lines: list[str] = []
    card = source.train_source(cfg, tmp_path / "part", progress=False, log=lines.append)
    assert lines[0].startswith("resumed") and len(lines) == 2  # one epoch left to run
    a = torch.load(tmp_path / "whole.pt", weights_only=True)
    b = torch.load(tmp_path / "part.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert card.clean_accuracy == whole.clean_accuracy and card.train_samples == 60
    assert card.data == f"cifar10c:{folder}" and card.class_names == list(CLASS_NAMES)
    assert not source.train_state_path(tmp_path / "part").exists()
    other = source.TrainConfig(**{**vars(cfg), "lr": 0.1})
    monkeypatch.setattr(source, "_save_state", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        source.train_source(cfg, tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match="another configuration"):
        source.train_source(other, tmp_path / "x", progress=False)


def test_training_data_errors_name_the_folder(tmp_path):
    from tta_core.model.source import TrainConfig, training_data

    with pytest.raises(ValueError, match=r"train\.npy not found"):
        training_data(TrainConfig(data=f"cifar10c:{tmp_path}"))
    with pytest.raises(ValueError, match="expected cifar10c:DIR"):
        training_data(TrainConfig(data=f"folder:{tmp_path}"))
    np.save(tmp_path / "train.npy", np.zeros((4, 32, 32, 3), np.uint8))
    np.save(tmp_path / "train_labels.npy", np.array([0, 1, 2, 30]))
    np.save(tmp_path / "test.npy", np.zeros((2, 32, 32, 3), np.uint8))
    np.save(tmp_path / "test_labels.npy", np.array([0, 1]))
    (tmp_path / "meta.json").write_text(json.dumps({"class_names": ["a", "b", "c"]}))
    with pytest.raises(ValueError, match="labels reach 30, but 3 class names"):
        training_data(TrainConfig(data=f"cifar10c:{tmp_path}"))


def test_iid_order_shuffles_each_domain_by_seed_and_keeps_the_domains(folder):
    spec = parse_data(f"cifar10c:{folder}")
    plain = load_data(spec, 32, severity=3)
    a, b = (load_data(spec, 32, severity=3, seed=s, order="iid") for s in (0, 1))
    assert a.domains.tolist() == plain.domains.tolist()
    assert not np.array_equal(a.images, b.images)
    for d in ("fog/3", "contrast/3"):  # the same images of each domain, reordered
        rows = plain.domains == d
        key = lambda im: sorted(x.tobytes() for x in im)  # noqa: E731
        assert key(a.images[rows]) == key(plain.images[rows])
        assert not np.array_equal(a.images[rows], plain.images[rows])
    held = load_data(spec, 32, corruptions=("speckle_noise", "fog"), order="iid")
    assert list(dict.fromkeys(held.domains.tolist())) == ["speckle_noise/5", "fog/5"]
    with pytest.raises(ValueError, match="no file for corruption"):
        load_data(spec, 32, corruptions=("snow",))

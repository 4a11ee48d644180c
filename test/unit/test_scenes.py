"""Synthetic driving scenes: determinism, classes, conditions, the on-disk layouts and
their readers (the bytes read back are the bytes rendered)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tta_core.data import scene_set as ss
from tta_core.data.scene_conditions import CONDITIONS, render_condition
from tta_core.data.scenes import CITYSCAPES_CLASSES, IGNORE, SCENE_CLASSES, render_scene
from tta_core.data.segmentation import load_acdc, load_cityscapes, load_segmentation

TINY = ss.SceneSetConfig(train=3, val=2, per_condition=2, seed=5)


@pytest.fixture(scope="module")
def scene_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("scenes")
    ss.generate(root, TINY, progress=False)
    return root


def test_scene_is_a_function_of_its_seed():
    a, b, c = render_scene((1, 2, 3)), render_scene((1, 2, 3)), render_scene((1, 2, 4))
    assert a.image.shape == (128, 256, 3) and a.label.shape == (128, 256)
    assert np.array_equal(a.image, b.image) and np.array_equal(a.label, b.label)
    assert not np.array_equal(a.image, c.image)


def test_scenes_use_cityscapes_train_ids():
    labels = np.concatenate([render_scene(i).label.ravel() for i in range(12)])
    present = set(np.unique(labels).tolist())
    assert present <= set(SCENE_CLASSES) | {IGNORE}
    assert len(present - {IGNORE}) >= 8
    assert CITYSCAPES_CLASSES[13] == "car" and CITYSCAPES_CLASSES[10] == "sky"
    assert np.mean(labels == IGNORE) < 0.05  # only object outlines are ignored


def test_conditions_change_appearance_deterministically():
    scene = render_scene(7)
    for c in CONDITIONS:
        out = render_condition(scene, c, 4, seed=3)
        assert out.shape == scene.image.shape and out.dtype == np.uint8
        assert np.abs(out.astype(int) - scene.image).mean() > 5, c
        assert np.array_equal(out, render_condition(scene, c, 4, seed=3)), c
    assert render_condition(scene, "night", 4, 0).mean() < 0.5 * scene.image.mean()
    with pytest.raises(ValueError, match="'hail'"):
        render_condition(scene, "hail", 4, 0)


def test_generate_writes_both_layouts_and_reads_back(scene_dir):
    assert (scene_dir / "leftImg8bit/train/synth00/synth00_000002_000019_leftImg8bit.png").is_file()
    assert (scene_dir / "gt/night/val/SYN1000/SYN1000_frame_000001_gt_labelTrainIds.png").is_file()
    val = load_cityscapes(scene_dir, "val")
    assert len(val) == 2 and set(val.domains) == {"clean"}
    ref = render_scene((TINY.seed, 2, 1))
    assert np.array_equal(val.images[1], ref.image) and np.array_equal(val.masks[1], ref.label)
    acdc = load_acdc(scene_dir)
    assert list(dict.fromkeys(acdc.domains)) == list(CONDITIONS)
    assert [d for _, _, d in acdc.batches(3)] == ["fog", "night", "rain", "snow"]
    assert list(load_segmentation(f"acdc:{scene_dir}", conditions=["rain"]).domains) == ["rain"] * 2
    half = load_cityscapes(scene_dir, "train", hw=(64, 128))
    assert half.images.shape == (3, 64, 128, 3)
    assert set(np.unique(half.masks)) <= set(np.unique(load_cityscapes(scene_dir, "train").masks))


def test_generate_keeps_resumes_and_verifies(scene_dir, tmp_path):
    assert ss.generate(scene_dir, TINY, progress=False).complete_before
    assert ss.verify(scene_dir) == []
    with pytest.raises(ValueError, match="another configuration"):
        ss.generate(scene_dir, ss.SceneSetConfig(train=4, val=2, per_condition=2, seed=5))
    root = tmp_path / "resume"
    (root / ss.PARTS).mkdir(parents=True)
    ss._work(str(root), ss._units(TINY)[0], TINY)  # a run stopped after its first unit
    report = ss.generate(root, TINY, progress=False)
    assert (report.kept, report.made) == (1, len(ss._units(TINY)) - 1)
    assert ss.fingerprint(root) == ss.fingerprint(scene_dir)
    rel = sorted(json.loads((root / ss.META).read_text())["files"])[0]
    (root / rel).write_bytes(b"x")
    assert ss.verify(root) == [rel]


def test_readers_name_what_is_missing(tmp_path, scene_dir):
    with pytest.raises(FileNotFoundError, match="leftImg8bit/val"):
        load_cityscapes(tmp_path)
    with pytest.raises(FileNotFoundError, match="rgb_anon"):
        load_acdc(tmp_path)
    with pytest.raises(ValueError, match="'folder:x'"):
        load_segmentation("folder:x")
    bad = tmp_path / "bad"
    img = next((scene_dir / "leftImg8bit/val").glob("*/*.png"))
    (bad / "leftImg8bit/val/c").mkdir(parents=True)
    (bad / "gtFine/val/c").mkdir(parents=True)
    (bad / "leftImg8bit/val/c/a_leftImg8bit.png").write_bytes(img.read_bytes())
    with pytest.raises(FileNotFoundError, match=r"a_gtFine_labelTrainIds\.png"):
        load_cityscapes(bad)
    import cv2

    cv2.imwrite(str(bad / "gtFine/val/c/a_gtFine_labelTrainIds.png"),
                np.full((128, 256), 26, np.uint8))  # Cityscapes labelId of car
    with pytest.raises(ValueError, match=r"\[26\].*labelIds"):
        load_cityscapes(bad)

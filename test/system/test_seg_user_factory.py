"""A user's own segmentation net, CLI only: a factory module and a Cityscapes-layout folder
written here, `tta model-card --task segmentation`, then `tta bench --task segmentation`
over every method that segments (subprocesses, as a user runs them).

Two factories share one network and one state_dict: one returns N x C x H x W logits (run
with every method), the other torchvision's {"out": logits, "aux": ...} (source and tent).
Source's mIoU must be what the network's own predictions score on the folder (computed
here, independently), the same for both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from helpers import ROOT

from tta_core.eval.seg_bench import SEG_METHODS

pytestmark = pytest.mark.slow

FACTORY = '''
import torch
from torch import nn


class TinySeg(nn.Module):
    """conv-BN-ReLU x 2 at half resolution, 1x1 classifier, bilinear upsampling."""

    def __init__(self, num_classes: int = 19) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Conv2d(8, num_classes, 1)

    def logits(self, x):
        y = self.head(self.body(x))
        return nn.functional.interpolate(y, size=x.shape[-2:], mode="bilinear",
                                         align_corners=False)

    def forward(self, x):
        return self.logits(x)


class TinySegDict(TinySeg):
    """The same network answering as torchvision's segmentation models do."""

    def forward(self, x):
        y = self.logits(x)
        return {"out": y, "aux": y.detach()}


def tiny(num_classes: int = 19) -> nn.Module:
    return TinySeg(num_classes)


def tiny_dict(num_classes: int = 19) -> nn.Module:
    return TinySegDict(num_classes)
'''
SIZE = 32
# every method that segments, less those that need an offline artifact fitted on the card
# (a DARDA bundle, a gated master: test_prepare builds those for a user's classifier)
METHODS = tuple(m for m in SEG_METHODS if m not in ("darda", "elastic"))


def _cityscapes(root: Path, n: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """n scenes at SIZE x SIZE as leftImg8bit/val/<city>/ and gtFine/val/<city>/ PNGs;
    (images RGB, masks) in the loader's order (sorted names)."""
    from tta_core.data.scenes import render_scene

    images, masks = [], []
    for i in range(n):
        s = render_scene((5, 5, i))
        img = cv2.resize(s.image, (SIZE, SIZE), interpolation=cv2.INTER_AREA)
        lab = cv2.resize(s.label, (SIZE, SIZE), interpolation=cv2.INTER_NEAREST)
        city = "aachen" if i < n // 2 else "bremen"
        for sub, name, arr in (("leftImg8bit", "leftImg8bit", img[..., ::-1]),
                               ("gtFine", "gtFine_labelTrainIds", lab)):
            path = root / sub / "val" / city / f"{city}_{i:06d}_000019_{name}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            assert cv2.imwrite(str(path), np.ascontiguousarray(arr))
        images.append(img)
        masks.append(lab)
    return np.stack(images), np.stack(masks)


def _tta(args: list[str], cwd: Path, pythonpath: Path) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(pythonpath), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tta_core.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def user_setup(tmp_path_factory: pytest.TempPathFactory):
    """(workdir, module dir, data folder, weights, the network, images, masks)."""
    work = tmp_path_factory.mktemp("user_seg")
    mods = work / "mods"
    mods.mkdir()
    (mods / "myseg.py").write_text(FACTORY)
    sys.path.insert(0, str(mods))
    try:
        import myseg
    finally:
        sys.path.remove(str(mods))
    torch.manual_seed(0)
    net = myseg.tiny().eval()
    with torch.no_grad():  # non-trivial BN statistics, so adaptation has something to move
        for bn in (m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.2, 0.2)
            bn.running_var.uniform_(0.5, 1.5)
    from safetensors.torch import save_file

    weights = work / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(weights))
    images, masks = _cityscapes(work / "cs")
    return work, mods, work / "cs", weights, net, images, masks


def _expected_miou(net: torch.nn.Module, images: np.ndarray, masks: np.ndarray,
                   card: dict) -> float:
    """Source's mIoU computed here: the network's argmax on the normalised images."""
    from tta_core.eval.miou import ConfusionMeter

    x = torch.from_numpy(images).float().div(255).permute(0, 3, 1, 2)
    x = (x - torch.tensor(card["mean"]).view(1, 3, 1, 1)) / torch.tensor(card["std"]).view(
        1, 3, 1, 1)
    with torch.no_grad():
        pred = net(x).argmax(1)
    meter = ConfusionMeter(19)
    meter.update(pred, torch.from_numpy(masks).long())
    return meter.scores().miou


@pytest.mark.parametrize(("factory", "methods"), [
    ("tiny", METHODS), ("tiny_dict", ("source", "tent"))])
def test_user_factory_runs_the_segmentation_methods(user_setup, factory: str,
                                                    methods: tuple[str, ...]) -> None:
    work, mods, data, weights, net, images, masks = user_setup
    card = work / f"{factory}.json"
    _tta(["model-card", "--model", f"myseg:{factory}", "--weights", str(weights),
          "--input-size", str(SIZE), "--norm", "imagenet", "--num-classes", "19",
          "--task", "segmentation", "--out", str(card)], work, mods)
    doc = json.loads(card.read_text())
    assert doc["task"] == "segmentation" and doc["factory"] == f"myseg:{factory}"
    out = work / f"bench_{factory}_{len(methods)}_{methods[-1]}"
    _tta(["bench", "--task", "segmentation", "--model-card", str(card), "--data",
          f"cityscapes:{data}", "--batch-size", "2", "--threads", "1", "--out", str(out),
          "--no-progress", "--methods", ",".join(methods)], work, mods)
    record = json.loads((out / "seg_bench.json").read_text())
    results = {r["method"]: r for r in record["results"]}
    assert tuple(results) == methods
    for name, r in results.items():
        assert list(r["miou"]) == ["clean"] and 0.0 <= r["mean_miou"] <= 1.0, (name, r)
        assert r["online_error"] == pytest.approx(1 - r["mean_miou"])
    assert results["source"]["mean_miou"] == pytest.approx(
        _expected_miou(net, images, masks, doc), abs=1e-9)
    # the adapting methods change predictions: not all of them can score exactly as source
    assert {round(r["mean_miou"], 9) for r in results.values()} != {
        round(results["source"]["mean_miou"], 9)}

"""Segmentation nets in the zoo, the card's task field, the classification loaders'
refusal of mask data, and resumable segmentation training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tta_core.cli import choices
from tta_core.data import scene_set as ss
from tta_core.data.sources import load_data, parse_data
from tta_core.errors import InputError
from tta_core.model.seg_source import SegTrainConfig, train_segmentation
from tta_core.model.source import load_card, load_source
from tta_core.model.zoo import SEG_ARCHS, SegmentationNet, build_model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch", SEG_ARCHS[:2])  # deeplabv3_resnet50: the same wrapper, 40 M
def test_segmentation_archs_return_dense_logits(arch):
    model = build_model(arch, 19).eval()
    assert isinstance(model, SegmentationNet)
    with torch.no_grad():
        assert model(torch.zeros(2, 3, 32, 64)).shape == (2, 19, 32, 64)
    assert choices.SEG_ARCHS == SEG_ARCHS


def test_old_cards_are_classification_and_tasks_are_checked(tmp_path):
    old = REPO / "checkpoints" / "small_resnet_signs32.json"
    assert "task" not in json.loads(old.read_text())
    card = load_card(old)
    assert card.task == "classification" and card.input_hw == (32, 32)
    raw = json.loads(old.read_text()) | {"task": "detection"}
    (tmp_path / "c.json").write_text(json.dumps(raw))
    with pytest.raises(InputError, match="'detection'"):
        load_card(tmp_path / "c.json")


def test_classification_loaders_refuse_mask_data(tmp_path):
    spec = parse_data(f"acdc:{tmp_path}")
    assert spec.kind == "acdc"
    with pytest.raises(InputError, match="segmentation"):
        load_data(spec, 32)


def test_training_resumes_to_the_same_weights(tmp_path):
    root = tmp_path / "scenes"
    ss.generate(root, ss.SceneSetConfig(train=3, val=2, per_condition=0, seed=1), progress=False)
    cfg = SegTrainConfig(data=f"cityscapes:{root}", epochs=2, batch_size=2, height=32,
                         width=64, threads=1)
    whole = train_segmentation(cfg, tmp_path / "whole" / "m", progress=False)

    def stop(line: str) -> None:
        if line.startswith("epoch 1/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_segmentation(cfg, tmp_path / "cut" / "m", progress=False, log=stop)
    assert (tmp_path / "cut" / "m.train.safetensors").is_file()
    lines: list[str] = []
    again = train_segmentation(cfg, tmp_path / "cut" / "m", progress=False, log=lines.append)
    assert lines[0].startswith("resumed") and "after epoch 1 of 2" in lines[0]
    a, _ = load_source(tmp_path / "whole" / "m.json")
    b, card = load_source(tmp_path / "cut" / "m.json")
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    assert card.task == "segmentation" and card.input_hw == (32, 64)
    assert again.clean_accuracy == pytest.approx(whole.clean_accuracy)
    with torch.no_grad():
        assert b(torch.zeros(1, 3, 32, 64)).shape == (1, 19, 32, 64)
    with pytest.raises(InputError, match="cityscapes:DIR"):
        train_segmentation(SegTrainConfig(data="folder:x"), tmp_path / "x")

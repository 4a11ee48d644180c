"""Segmentation nets in the zoo, the card's task field, the classification loaders'
refusal of mask data, and resumable segmentation training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tta_core.cli import choices
from tta_core.data import scene_set as ss
from tta_core.data.segmentation import load_segmentation
from tta_core.data.sources import load_data, parse_data
from tta_core.errors import InputError
from tta_core.eval.seg_bench import SegBenchConfig, run_seg_bench
from tta_core.eval.seg_train import SegTrainConfig, evaluate, train_segmentation
from tta_core.model.source import load_card, load_source
from tta_core.model.zoo import SEG_ARCHS, SegmentationNet
from tta_core.runtime import losses

REPO = Path(__file__).resolve().parents[2]


def test_segmentation_net_returns_the_out_logits():
    # the torchvision builders are one code path; LR-ASPP is built and trained below
    class Dict(torch.nn.Module):
        def forward(self, x):
            return {"out": x * 2, "aux": x}

    x = torch.randn(2, 3, 4, 5)
    assert torch.equal(SegmentationNet(Dict())(x), x * 2)
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny scene set and a card trained on it for two epochs: (root, cfg, card path)."""
    root = tmp_path_factory.mktemp("seg")
    ss.generate(root / "scenes", ss.SceneSetConfig(train=3, val=2, per_condition=3, seed=1),
                progress=False)
    cfg = SegTrainConfig(data=f"cityscapes:{root / 'scenes'}", epochs=2, batch_size=2,
                         height=32, width=64, threads=1)
    train_segmentation(cfg, root / "whole" / "m", progress=False)
    return root, cfg, root / "whole" / "m.json"


def test_training_resumes_to_the_same_weights(tmp_path, trained):
    _, cfg, card_path = trained
    whole = load_card(card_path)

    def stop(line: str) -> None:
        if line.startswith("epoch 1/"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_segmentation(cfg, tmp_path / "cut" / "m", progress=False, log=stop)
    assert (tmp_path / "cut" / "m.train.safetensors").is_file()
    lines: list[str] = []
    again = train_segmentation(cfg, tmp_path / "cut" / "m", progress=False, log=lines.append)
    assert lines[0].startswith("resumed") and "after epoch 1 of 2" in lines[0]
    a, _ = load_source(card_path)
    b, card = load_source(tmp_path / "cut" / "m.json")
    for (k, v), w in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    assert card.task == "segmentation" and card.input_hw == (32, 64)
    assert again.clean_accuracy == pytest.approx(whole.clean_accuracy)
    with torch.no_grad():
        assert b(torch.zeros(1, 3, 32, 64)).shape == (1, 19, 32, 64)
    with pytest.raises(InputError, match="cityscapes:DIR"):
        train_segmentation(SegTrainConfig(data="folder:x"), tmp_path / "x")


def test_entropy_loss_is_the_mean_per_pixel_entropy():
    logits = torch.randn(2, 5, 3, 4, generator=torch.Generator().manual_seed(0))
    flat = logits.permute(0, 2, 3, 1).reshape(-1, 5)
    p = flat.softmax(1)
    assert float(losses.entropy_loss(logits)) == pytest.approx(
        float(-(p * p.log()).sum(1).mean()), rel=1e-6)
    with pytest.raises(ValueError, match=r"\[B, K, H, W\]"):
        losses.entropy_loss(torch.zeros(2, 5, 3))


def test_seg_bench_source_scores_equal_a_direct_evaluation(trained):
    root, _, card_path = trained
    cfg = SegBenchConfig(model_card=card_path, data=f"acdc:{root / 'scenes'}",
                         methods=("source", "bn_adapt"), batch_size=2)
    results, text = run_seg_bench(cfg, root / "bench", progress=False)
    model, card = load_source(card_path)
    for cond in ("fog", "night", "rain", "snow"):
        data = load_segmentation(cfg.data, hw=card.input_hw, conditions=[cond])
        want = evaluate(model, data, card.mean, card.std).miou
        assert results[0].miou[cond] == pytest.approx(want, abs=1e-12), cond
    assert results[1].miou != results[0].miou  # batch statistics change the prediction
    assert "| bn_adapt |" in text and (root / "bench" / "seg_bench.json").is_file()
    with pytest.raises(InputError, match="'lame' does not support segmentation"):
        run_seg_bench(SegBenchConfig(model_card=card_path, data=cfg.data, methods=("lame",)))


def test_user_cards_carry_the_task(trained):
    from tta_core.model.user_card import UserModel, check_card_model, make_card

    root = trained[0]
    user = UserModel(model="lraspp_mobilenet_v3_large", weights=root / "whole" / "m.safetensors",
                     input_size=32, mean=(0.5,) * 3, std=(0.25,) * 3, num_classes=19,
                     task="segmentation")
    card = make_card(user)
    assert card.task == "segmentation"
    check_card_model(card)
    user.task = "classification"
    with pytest.raises(InputError, match=r"expected \(2, 19\)"):
        check_card_model(make_card(user))

"""Source training learns, and the model card round-trips and guards the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tta_core.cli import main
from tta_core.model.source import TrainConfig, load_card, load_source, train_source


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    cfg = TrainConfig(epochs=2, train_samples=600, val_samples=200, batch_size=64, lr=0.1,
                      seed=3)
    return train_source(cfg, out, progress=False), out


@pytest.mark.slow
def test_short_training_beats_chance_and_card_round_trips(tiny):
    card, out = tiny
    assert card.clean_accuracy > 3.0 / card.num_classes  # chance is 1/22
    again = load_card(out.with_suffix(".json"))
    assert again == card
    model, c2 = load_source(out.with_suffix(".json"))
    assert c2.arch == "small_resnet" and not model.training
    state = torch.load(out.with_suffix(".pt"), weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_card_that_does_not_fit_the_checkpoint_is_refused(tiny, tmp_path):
    _card, out = tiny
    raw = json.loads(out.with_suffix(".json").read_text())
    raw["num_classes"], raw["class_names"] = 5, raw["class_names"][:5]
    raw["checkpoint"] = str(out.with_suffix(".pt"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="does not fit arch 'small_resnet' with 5 classes"):
        load_source(bad)
    raw["arch"] = "alexnet"
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="arch 'alexnet'"):
        load_source(bad)
    with pytest.raises(FileNotFoundError, match="train-source"):
        load_source(tmp_path / "nope.json")


def test_cli_rejects_bad_epochs():
    with pytest.raises(SystemExit, match="--epochs must be >= 1, got 0"):
        main(["train-source", "--epochs", "0"])


@pytest.mark.slow
def test_cli_half_safetensors_at_96px(tmp_path):
    """--half --safetensors: one float16 .safetensors file (no .pt left), named by the card,
    loading into a float32 model whose accuracy is the card's (re-measured after rounding)."""
    from safetensors.torch import load_file

    from tta_core.data.preprocess import images_to_tensor
    from tta_core.data.signs import make_signs

    out = tmp_path / "w16"
    assert main(["train-source", "--arch", "resnet18_cifar_w16", "--image-size", "96",
                 "--epochs", "1", "--train-samples", "44", "--val-samples", "22",
                 "--batch-size", "22", "--seed", "5", "--half", "--safetensors",
                 "--out", str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w16.json", "w16.safetensors"]
    state = load_file(str(out.with_suffix(".safetensors")))
    assert {v.dtype for v in state.values()} == {torch.float16, torch.int64}
    model, card = load_source(out.with_suffix(".json"))
    assert card.checkpoint == "w16.safetensors" and card.image_size == 96
    assert all(p.dtype == torch.float32 for p in model.parameters())
    val = make_signs(22, 96, seed=5 + 10_000)
    x = images_to_tensor(val.images, card.mean, card.std)
    with torch.no_grad():  # counted here, not by the accuracy() the card was written with
        hits = int((model.eval()(x).argmax(1).numpy() == val.labels).sum())
    assert card.clean_accuracy == hits / len(val.labels)

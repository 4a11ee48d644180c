"""The shipped source checkpoints load, classify clean held-out signs and decompose."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.model.source import accuracy, load_source
from tta_core.model.units import decompose

CKPTS = Path(__file__).resolve().parent.parent / "checkpoints"
HELD_OUT_SEED = 20_000  # neither the training (seed 0) nor the card's validation (10 000) set

# card -> (units, stages, min accuracy on 300 held-out signs: measured minus a margin)
SHIPPED = {
    "small_resnet_signs32.json": (19, 5, 0.90),
    "resnet18_cifar_w32_signs64.json": (41, 10, 0.94),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_card_classifies_clean_signs(name: str) -> None:
    units, stages, min_acc = SHIPPED[name]
    torch.set_num_threads(2)
    model, card = load_source(CKPTS / name)
    assert card.arch in name and card.checkpoint == name.replace(".json", ".pt")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    val = make_signs(300, card.image_size, seed=HELD_OUT_SEED)
    x = images_to_tensor(val.images, card.mean, card.std)
    acc = accuracy(model, x, torch.from_numpy(val.labels), batch=100)
    assert acc >= min_acc, f"{name}: {acc:.3f} < {min_acc}"
    staged = decompose(model, (3, card.image_size, card.image_size), card.arch)
    assert (len(staged.units), len(staged.stages)) == (units, stages)
    assert staged.units[0].name == "conv1" and staged.units[-1].name == "fc"
    assert sum(u.params for u in staged.units) == sum(p.numel() for p in model.parameters())
    assert all(u.macs_fwd > 0 and u.eta > 0 for u in staged.units)

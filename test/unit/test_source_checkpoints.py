"""The shipped source checkpoints load, classify clean held-out signs and decompose."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import ROOT

from tta_core.adashadow.engine import AdaShadowEngine, EngineConfig
from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.model.source import accuracy, load_source
from tta_core.model.units import decompose

CKPTS = ROOT / "checkpoints"
HELD_OUT_SEED = 20_000  # neither the training (seed 0) nor the card's validation (10 000) set

# card -> (units, stages, min accuracy on these 300 held-out signs): measured 0.957 and
# 0.997 (float16 weights), less a margin of about 5 points
SHIPPED = {
    "small_resnet_signs32.json": (19, 5, 0.90),
    "resnet18_cifar_w32_signs64.json": (41, 10, 0.95),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_card_classifies_clean_signs(name: str) -> None:
    units, stages, min_acc = SHIPPED[name]
    torch.set_num_threads(2)
    model, card = load_source(CKPTS / name)
    assert card.arch in name and card.checkpoint.startswith(name.removesuffix(".json"))
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


@pytest.mark.slow
def test_adashadow_plans_and_steps_on_the_64px_card() -> None:
    """The engine decomposes the shipped ResNet-18, plans within its budget and updates
    norm units only (the default trainable set), batch after batch."""
    torch.set_num_threads(2)
    model, card = load_source(CKPTS / "resnet18_cifar_w32_signs64.json")
    staged = decompose(model, (3, 64, 64), card.arch)
    bn_units = sum(u.kind == "bn" for u in staged.units)
    eng = AdaShadowEngine(staged, EngineConfig())
    val = make_signs(12, 64, seed=HELD_OUT_SEED)
    x = images_to_tensor(val.images, card.mean, card.std)
    try:
        steps = [eng.step(x[i:i + 4]) for i in range(0, 12, 4)]
    finally:
        eng.close()
    assert all(r.logits.shape == (4, card.num_classes) for r in steps)
    assert any(r.adapted for r in steps)
    for r in steps:
        update = np.asarray(r.plan.update)
        assert r.units_updated == int(update.sum()) <= bn_units and r.adapted == update.any()
        assert len(r.importance) == len(staged.units)
        assert not update[[u.kind != "bn" for u in staged.units]].any()


@pytest.mark.parametrize(("path", "kind"), [("/dev/zero", "a character device"),
                                            ("/", "a directory")])
def test_checkpoint_that_is_not_a_regular_file_is_named_so(path: str, kind: str) -> None:
    """/dev/zero or a directory is not 'missing': it is there and not a file (reading
    /dev/zero would never end)."""
    import dataclasses

    from tta_core.errors import InputError
    from tta_core.model.source import load_card, load_model
    from tta_core.model.weights import load_state_dict

    card = dataclasses.replace(load_card(ROOT / "checkpoints" / "small_resnet_signs32.json"),
                               checkpoint=path)
    for load, what in ((lambda: load_model(card), f"checkpoint {path!r} named by the card"),
                       (lambda: load_state_dict(path), f"weights file {path!r}"),
                       (lambda: load_card(path), f"model card {path!r}")):
        with pytest.raises(InputError) as info:
            load()
        assert str(info.value) == f"{what} is not a regular file ({kind})"
    with pytest.raises(FileNotFoundError, match="is missing"):
        load_model(dataclasses.replace(card, checkpoint="/no/such/file.safetensors"))

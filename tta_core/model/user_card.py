"""A model card for a user's own model: a torchvision arch or a factory, a weights file, and
how the model reads images (input size, normalisation), given explicitly.

`tta model-card` writes such a card; `tta bench --model ... --weights ...` makes one in
memory. Nothing is assumed: without an input size or a normalisation the card is refused
(a 224 px ImageNet default would silently mis-feed a 32 px CIFAR model).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tta_core.errors import InputError, one_line, require_file
from tta_core.model.arch import factory_kwargs, is_factory
from tta_core.model.source import ModelCard, load_model

NORM_PRESETS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "none": ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)),  # [0, 1] pixels
}


@dataclass
class UserModel:
    """A user's model as given on the command line (see `make_card`)."""

    model: str  # torchvision/tta arch name, or a factory 'package.module:function'
    weights: Path  # state_dict: torch file (weights_only) or .safetensors
    input_size: int = 0  # pixels (square); 0 = not given, refused
    mean: tuple[float, ...] = ()  # per channel, in [0, 1] pixel units; () = not given
    std: tuple[float, ...] = ()
    num_classes: int = 0  # 0: len(class_names)
    class_names: tuple[str, ...] = ()  # () with num_classes: '0', '1', ...
    kwargs: dict = field(default_factory=dict)  # builder keyword arguments (JSON)
    name: str = ""
    task: str = "classification"  # or segmentation: the model outputs N x C x H x W

    def check(self) -> None:
        """ValueError naming the first missing or bad value (before anything is built)."""
        what = f"--model {self.model}"
        if not self.model.strip():
            raise ValueError("--model is empty: give a torchvision arch (e.g. resnet18) or a "
                             "factory package.module:function")
        if self.input_size <= 0:
            raise ValueError(f"{what} needs --input-size (the model's input in pixels, e.g. "
                             "32 for CIFAR-10, 224 for ImageNet): it is never assumed")
        if self.input_size < 8:
            raise ValueError(f"--input-size {self.input_size} is too small (>= 8)")
        if not self.mean or not self.std:
            raise ValueError(f"{what} needs its normalisation: --norm "
                             f"{'|'.join(NORM_PRESETS)} or --mean R,G,B --std R,G,B")
        if len(self.mean) != 3 or len(self.std) != 3 or not all(
                math.isfinite(v) for v in (*self.mean, *self.std)) or min(self.std) <= 0:
            raise ValueError(f"--mean {self.mean} / --std {self.std}: need 3 finite values "
                             "each, std > 0")
        if self.num_classes and self.class_names and \
                self.num_classes != len(self.class_names):
            raise ValueError(f"--num-classes {self.num_classes} but {len(self.class_names)} "
                             "class names")

    def classes(self) -> list[str]:
        """The class names: given, else '0'..'N-1'; ValueError when neither is known."""
        if self.class_names:
            return list(self.class_names)
        if self.num_classes < 2:
            raise ValueError(f"--model {self.model} needs --num-classes N (>= 2) or "
                             f"--class-names, got {self.num_classes}")
        return [str(i) for i in range(self.num_classes)]


def _checkpoint_entry(weights: Path, card_dir: Path | None) -> str:
    """The card's checkpoint field: relative to the card's folder when the weights are
    inside it, else absolute."""
    full = weights.resolve()
    if card_dir is not None:
        base = Path(card_dir).resolve()
        if full.is_relative_to(base):
            return os.path.relpath(full, base)
    return str(full)


def make_card(user: UserModel, card_dir: Path | None = None) -> ModelCard:
    """The card of `user`'s model, for a card file written in `card_dir` (None: a card
    kept in memory, checkpoint absolute). Checks values, not weights (`check_card_model`)."""
    user.check()
    require_file(user.weights, f"weights file {str(user.weights)!r}",
                 f"weights file {str(user.weights)!r} not found")
    classes = user.classes()
    factory, arch, kwargs = "", user.model, dict(user.kwargs)
    if is_factory(user.model):
        factory, arch = user.model, user.model.partition(":")[2]
        kwargs = factory_kwargs(factory, len(classes), kwargs)
    card = ModelCard(arch=arch, num_classes=len(classes), class_names=classes,
                     image_size=int(user.input_size), mean=[float(v) for v in user.mean],
                     std=[float(v) for v in user.std],
                     checkpoint=_checkpoint_entry(Path(user.weights), card_dir),
                     name=user.name or f"{arch}_{Path(user.weights).stem}",
                     factory=factory, kwargs=kwargs, task=user.task)
    card.validate()
    return card


@torch.no_grad()
def check_card_model(card: ModelCard, base_dir: str | Path = ".") -> torch.nn.Module:
    """The card's model with its weights, after one forward on two blank images of the
    card's size: InputError when the weights do not fit, the model cannot take that size,
    or it does not output num_classes scores."""
    model = load_model(card, base_dir)
    s = card.image_size
    try:
        out = model(torch.zeros(2, 3, s, s))
    except RuntimeError as exc:
        text = one_line(exc)
        raise InputError(f"{card.arch} does not run on {s}x{s} px inputs (input size "
                         f"{s}): {text[:200]}") from None
    want = (2, card.num_classes) + ((s, s) if card.task == "segmentation" else ())
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise InputError(f"{card.arch} outputs {shape} for 2 images, expected {want}: "
                         f"num_classes {card.num_classes} or task {card.task!r} does not "
                         "match the model")
    return model

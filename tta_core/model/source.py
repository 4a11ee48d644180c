"""Train the source model on clean synthetic signs and describe it with a model card.

The card (JSON next to the checkpoint) is what every consumer reads: architecture, classes,
input size and normalisation, clean accuracy, seed. The architecture is a tta arch, a
torchvision model name or a user's factory `package.module:function` with its kwargs
(tta_core.model.arch); `tta model-card` writes a card for a user's model and weights.
Checkpoints are plain state_dicts, always loaded with `torch.load(weights_only=True)`, or
`.safetensors` files (tta_core.model.weights).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.errors import InputError, require_file
from tta_core.io.strict_json import dumps as json_dumps
from tta_core.model.arch import build_architecture, check_arch
from tta_core.model.weights import load_into, load_state_dict
from tta_core.model.zoo import build_model

__all__ = ["CARD_SCHEMA", "ModelCard", "TrainConfig", "build_card_model", "load_card",
           "load_model", "load_source", "load_state_dict", "save_card", "train_source"]

CARD_SCHEMA = "tta.model_card/1"


@dataclass
class ModelCard:
    """What a consumer needs to run a source checkpoint."""

    arch: str
    num_classes: int
    class_names: list[str]
    image_size: int
    mean: list[float]
    std: list[float]
    checkpoint: str  # weights file: relative to the card's folder, or absolute
    clean_accuracy: float = float("nan")
    seed: int = 0
    epochs: int = 0
    train_samples: int = 0
    torch_version: str = torch.__version__
    name: str = ""
    schema: str = CARD_SCHEMA
    # '' (arch names a tta or torchvision model) or 'package.module:function' called with
    # `kwargs` exactly; arch then only names the architecture
    factory: str = ""
    kwargs: dict = field(default_factory=dict)  # JSON keyword arguments of the builder

    def validate(self) -> None:
        """ValueError naming the first inconsistent field."""
        if self.schema != CARD_SCHEMA:
            raise ValueError(f"schema {self.schema!r}, expected {CARD_SCHEMA!r}")
        check_arch(self.arch, self.factory, self.kwargs)
        if len(self.class_names) != self.num_classes:
            raise ValueError(f"class_names lists {len(self.class_names)} names for "
                             f"num_classes={self.num_classes}")
        if len(self.mean) != 3 or len(self.std) != 3 or min(self.std) <= 0:
            raise ValueError(f"mean/std must be 3 values, std > 0: {self.mean}, {self.std}")
        if self.image_size < 8:
            raise ValueError(f"image_size {self.image_size} too small (>= 8)")


@dataclass
class TrainConfig:
    """Source training on CPU in minutes (defaults: small_resnet, 32 px)."""

    arch: str = "small_resnet"
    image_size: int = 32
    epochs: int = 6
    train_samples: int = 8000
    val_samples: int = 1000
    batch_size: int = 128
    lr: float = 0.05
    weight_decay: float = 5e-4
    seed: int = 0
    threads: int = 2  # torch threads (0: torch default)
    pad: int = 2  # random-translation augmentation (no test corruption is used)
    extra: dict = field(default_factory=dict)


def _augment(x: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """Random translations by up to `pad` px (reflect padding); nothing else, so the test
    corruptions stay unseen (no flips either: they would swap turn_left and turn_right)."""
    if pad <= 0:
        return x
    n, _, h, w = x.shape
    xp = nn.functional.pad(x, (pad, pad, pad, pad), mode="reflect")
    dy = torch.randint(0, 2 * pad + 1, (n, 1, 1), generator=gen)
    dx = torch.randint(0, 2 * pad + 1, (n, 1, 1), generator=gen)
    rows = dy + torch.arange(h).view(1, h, 1)
    cols = dx + torch.arange(w).view(1, 1, w)
    return xp[torch.arange(n).view(n, 1, 1), :, rows, cols].permute(0, 3, 1, 2)


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 512) -> float:
    """Top-1 accuracy of `model` (eval mode) on tensors x, y."""
    model.eval()
    hits = sum(int((model(x[i:i + batch]).argmax(1) == y[i:i + batch]).sum())
               for i in range(0, len(y), batch))
    return hits / max(len(y), 1)


def train_source(cfg: TrainConfig, out: Path, progress: bool = True) -> ModelCard:
    """Train, evaluate on a held-out seed, save `<out>.pt` + `<out>.json`; return the card."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    train = make_signs(cfg.train_samples, cfg.image_size, seed=cfg.seed, progress=progress)
    val = make_signs(cfg.val_samples, cfg.image_size, seed=cfg.seed + 10_000, progress=progress)
    flat = train.images.reshape(-1, 3).astype(np.float64) / 255.0
    mean, std = flat.mean(0).tolist(), flat.std(0).tolist()
    xtr, ytr = images_to_tensor(train.images, mean, std), torch.from_numpy(train.labels)
    xva, yva = images_to_tensor(val.images, mean, std), torch.from_numpy(val.labels)
    model = build_model(cfg.arch, len(train.class_names))
    steps = cfg.epochs * -(-len(ytr) // cfg.batch_size)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=0.9, nesterov=True,
                          weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps)
    gen = torch.Generator().manual_seed(cfg.seed)
    bar = _progress(steps, progress)
    for epoch in range(cfg.epochs):
        model.train()
        perm = torch.randperm(len(ytr), generator=gen)
        for i in range(0, len(ytr), cfg.batch_size):
            idx = perm[i:i + cfg.batch_size]
            loss = nn.functional.cross_entropy(model(_augment(xtr[idx], cfg.pad, gen)), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{loss.detach().item():.3f}")
    bar.close()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    card = ModelCard(arch=cfg.arch, num_classes=len(train.class_names),
                     class_names=list(train.class_names), image_size=cfg.image_size,
                     mean=mean, std=std, checkpoint=out.with_suffix(".pt").name,
                     clean_accuracy=accuracy(model, xva, yva), seed=cfg.seed,
                     epochs=cfg.epochs, train_samples=cfg.train_samples,
                     name=f"{cfg.arch}_signs{cfg.image_size}")
    torch.save(model.state_dict(), out.with_suffix(".pt"))
    save_card(card, out.with_suffix(".json"))
    return card


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="train-source", unit="step", disable=not enabled)


def save_card(card: ModelCard, path: Path) -> None:
    """Write the card as JSON (atomically: temp file then rename)."""
    card.validate()
    tmp = Path(path).with_suffix(".json.tmp")
    tmp.write_text(json_dumps(asdict(card), indent=1) + "\n")
    tmp.replace(path)


# JSON type of each card field (the dataclass annotations, as strings)
_JSON_TYPES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "str": ("a string", lambda v: isinstance(v, str)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)),
    "dict": ("a JSON object", lambda v: isinstance(v, dict)),
    "list[str]": ("a list of strings",
                  lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "list[float]": ("a list of numbers", lambda v: isinstance(v, list) and all(
        isinstance(x, int | float) and not isinstance(x, bool) for x in v)),
}


def _card_fields(raw: Any) -> str:
    """'' when `raw` (parsed JSON) has exactly the card's fields with their types, else
    what is wrong (names the field and the value)."""
    if not isinstance(raw, dict):
        return f"expected a JSON object, got {type(raw).__name__}"
    fields = ModelCard.__dataclass_fields__
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        return f"unknown field(s) {unknown}"
    missing = [n for n, f in fields.items() if n not in raw and f.default is MISSING
               and f.default_factory is MISSING]
    if missing:
        return f"missing field(s) {missing}"
    for name, value in raw.items():
        what, ok = _JSON_TYPES[str(fields[name].type)]
        if not ok(value):
            return f"{name} must be {what}, got {value!r}"
    return ""


def load_card(path: str | Path) -> ModelCard:
    """Read and validate a model card; InputError naming the file and the bad field."""
    path = Path(path)
    require_file(path, f"model card {str(path)!r}", f"model card {str(path)!r} not found "
                 "(make one with `tta train-source`)")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"model card {path} is not valid JSON ({exc})") from None
    if isinstance(raw, dict):  # strict JSON (tta_core.io.strict_json) writes NaN as null
        floats = {n for n, f in ModelCard.__dataclass_fields__.items() if str(f.type) == "float"}
        raw = {k: float("nan") if v is None and k in floats else v for k, v in raw.items()}
    problem = _card_fields(raw)
    if problem:
        raise InputError(f"model card {path}: {problem}")
    card = ModelCard(**raw)
    try:
        card.validate()
    except ValueError as exc:
        raise InputError(f"model card {path}: {exc}") from None
    return card


def build_card_model(card: ModelCard) -> nn.Module:
    """The card's architecture with random weights (its arch, or its factory and kwargs)."""
    return build_architecture(card.arch, card.num_classes, card.factory, card.kwargs)


def load_model(card: ModelCard, base_dir: str | Path = ".",
               device: str | torch.device = "cpu") -> nn.Module:
    """The card's model in eval mode with its checkpoint's weights (a relative checkpoint
    is found in `base_dir`, the card's folder); InputError naming the mismatching keys."""
    ckpt = Path(base_dir) / card.checkpoint
    require_file(ckpt, f"checkpoint {str(ckpt)!r} named by the card",
                 f"checkpoint {str(ckpt)!r} named by the card is missing")
    model = build_card_model(card)
    what = (f"checkpoint {str(ckpt)!r} does not fit arch {card.arch!r}"
            + (f" (factory {card.factory})" if card.factory else "")
            + f" with {card.num_classes} classes")
    load_into(model, load_state_dict(ckpt), what)
    return model.to(device).eval()


def load_source(card_path: str | Path, device: str | torch.device = "cpu"
                ) -> tuple[nn.Module, ModelCard]:
    """(model in eval mode with the source weights, its card); weights_only loading. What
    the bench, the perception node and the replay load a card with."""
    card = load_card(card_path)
    return load_model(card, Path(card_path).parent, device), card

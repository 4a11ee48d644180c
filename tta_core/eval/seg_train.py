"""Train a segmentation source model and describe it with a model card (task segmentation).

Training data: a Cityscapes-layout folder's train split (`SegTrainConfig.data =
"cityscapes:DIR"`, what `tta make-benchmark --scenes` writes, or the real dataset with
labelTrainIds masks); the card's clean mIoU is measured on its val split. Loss: per-pixel
cross-entropy ignoring 255; AdamW with a one-cycle schedule; augmentation: horizontal
flips only (no colour or weather change, so the ACDC-style conditions stay unseen).
Like `train_source`, the whole state is saved after every epoch to
`<out>.train.safetensors` and a run started again resumes after the last finished epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.scenes import CITYSCAPES_CLASSES, IGNORE
from tta_core.data.segmentation import SegmentationSet, load_segmentation, mask_tensor
from tta_core.errors import InputError
from tta_core.eval.miou import ConfusionMeter, SegScores
from tta_core.model.source import (
    ModelCard,
    _save_state,
    optimizer_step,
    resume,
    save_card,
)
from tta_core.model.zoo import SEG_ARCHS, build_model


@dataclass
class SegTrainConfig:
    """Segmentation source training (defaults: LR-ASPP MobileNetV3-large, one CPU thread)."""

    data: str = ""
    arch: str = "lraspp_mobilenet_v3_large"
    epochs: int = 8
    train_samples: int = 0  # 0: the whole train split
    val_samples: int = 0  # 0: the whole val split
    batch_size: int = 8
    lr: float = 2e-3
    weight_decay: float = 1e-4
    seed: int = 0
    threads: int = 1
    height: int = 128
    width: int = 256

    def validate(self) -> None:
        """ValueError naming the first bad field."""
        if self.arch not in SEG_ARCHS:
            raise ValueError(f"arch {self.arch!r} is not a segmentation net; choose from "
                             f"{', '.join(SEG_ARCHS)}")
        if not self.data.startswith("cityscapes:"):
            raise ValueError(f"--data {self.data!r}: segmentation training reads "
                             "cityscapes:DIR (its train and val splits)")
        for name in ("epochs", "batch_size", "height", "width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def _batch(images: np.ndarray, masks: np.ndarray, mean: list[float], std: list[float]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    return images_to_tensor(images, mean, std), mask_tensor(masks)


@torch.no_grad()
def evaluate(model: nn.Module, data: SegmentationSet, mean: list[float], std: list[float],
             num_classes: int = len(CITYSCAPES_CLASSES), batch: int = 16) -> SegScores:
    """mIoU and per-class IoU of `model` (eval mode) on `data`."""
    model.eval()
    meter = ConfusionMeter(num_classes)
    for images, masks, _ in data.batches(batch):
        x, y = _batch(images, masks, mean, std)
        meter.update(model(x), y)
    return meter.scores(list(CITYSCAPES_CLASSES[:num_classes]))


def _epoch(model: nn.Module, train: SegmentationSet, cfg: SegTrainConfig, mean: list[float],
           std: list[float], opt: torch.optim.Optimizer, sched, gen: torch.Generator,
           tick: Callable[[float], object]) -> float:
    model.train()
    perm = torch.randperm(len(train), generator=gen).numpy()
    total = 0.0
    for i in range(0, len(perm), cfg.batch_size):
        idx = np.sort(perm[i:i + cfg.batch_size])
        x, y = _batch(train.images[idx], train.masks[idx], mean, std)
        flip = torch.rand(len(idx), generator=gen) < 0.5
        x[flip], y[flip] = x[flip].flip(-1), y[flip].flip(-1)
        value = optimizer_step(nn.functional.cross_entropy(model(x), y, ignore_index=IGNORE),
                               opt, sched)
        total += value * len(idx)
        tick(value)
    return total / len(perm)


def train_segmentation(cfg: SegTrainConfig, out: Path, progress: bool = True,
                       log: Callable[[str], None] | None = None) -> ModelCard:
    """Train (resuming from `<out>.train.safetensors`), measure the val mIoU, save
    `<out>.safetensors` + `<out>.json` (task segmentation); return the card."""
    try:
        cfg.validate()
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    hw = (cfg.height, cfg.width)
    train = load_segmentation(cfg.data, "train", hw, cfg.train_samples or None)
    val = load_segmentation(cfg.data, "val", hw, cfg.val_samples or None)
    flat = train.images[:: max(1, len(train) // 500)].reshape(-1, 3).astype(np.float64) / 255
    mean, std = flat.mean(0).tolist(), flat.std(0).tolist()
    model = build_model(cfg.arch, len(CITYSCAPES_CLASSES))
    per_epoch = -(-len(train) // cfg.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr,
                                                total_steps=cfg.epochs * per_epoch)
    gen = torch.Generator().manual_seed(cfg.seed)
    out = Path(out)
    state_path, done, history = resume(out, cfg, model, opt, sched, gen, log)
    from tqdm import tqdm

    bar = tqdm(total=cfg.epochs * per_epoch, initial=done * per_epoch, desc="train-seg",
               unit="step", disable=not progress)
    for epoch in range(done, cfg.epochs):
        def tick(v: float, e: int = epoch + 1) -> None:
            bar.update(1)
            bar.set_postfix(epoch=e, loss=f"{v:.3f}")

        loss = _epoch(model, train, cfg, mean, std, opt, sched, gen, tick)
        history.append({"epoch": epoch + 1, "loss": loss,
                        "val_miou": evaluate(model, val, mean, std).miou})
        _save_state(state_path, cfg, epoch + 1, model, opt, sched, gen, history)
        _write_card(model, cfg, out, mean, std, history[-1]["val_miou"], len(train), epoch + 1)
        if log:
            log(f"epoch {epoch + 1}/{cfg.epochs}: loss {loss:.4f}, val mIoU "
                f"{history[-1]['val_miou']:.4f} (state in {state_path})")
    bar.close()
    card = _write_card(model, cfg, out, mean, std, evaluate(model, val, mean, std).miou,
                       len(train), cfg.epochs)
    state_path.unlink(missing_ok=True)
    return card


def _write_card(model: nn.Module, cfg: SegTrainConfig, out: Path, mean: list[float],
                std: list[float], miou: float, n_train: int, epochs: int) -> ModelCard:
    """float16 weights as `<out>.safetensors` and the card after `epochs` epochs
    (rewritten every epoch, so an unfinished run leaves a usable card of its last one)."""
    import safetensors.torch

    card = ModelCard(arch=cfg.arch, num_classes=len(CITYSCAPES_CLASSES),
                     class_names=list(CITYSCAPES_CLASSES), image_size=cfg.width,
                     image_height=cfg.height, mean=mean, std=std,
                     checkpoint=out.with_suffix(".safetensors").name, clean_accuracy=miou,
                     seed=cfg.seed, epochs=epochs, train_samples=n_train, name=out.stem,
                     data=cfg.data, task="segmentation")
    state = {k: (v.half() if v.is_floating_point() else v).detach().contiguous()
             for k, v in model.state_dict().items()}
    tmp = out.with_name(out.name + ".tmp.safetensors")
    safetensors.torch.save_file(state, str(tmp), metadata={"card": out.with_suffix(".json").name})
    tmp.replace(out.with_suffix(".safetensors"))
    save_card(card, out.with_suffix(".json"))
    return card

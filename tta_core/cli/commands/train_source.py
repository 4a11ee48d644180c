"""`tta train-source`: train the source model on clean synthetic signs (CPU, minutes).

`--half` stores the weights as float16 (half the file, for checkpoints shipped in git);
they load into the float32 model unchanged (`load_state_dict` casts), and the card's clean
accuracy is measured again with the rounded weights.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from tta_core.data.preprocess import images_to_tensor
from tta_core.data.signs import make_signs
from tta_core.model.source import (ModelCard, TrainConfig, accuracy, load_source, save_card,
                                   train_source)
from tta_core.model.zoo import ARCHS

NAME = "train-source"
HELP = "train the source model on clean synthetic traffic signs; write checkpoint + card"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    parser.add_argument("--arch", choices=ARCHS, default=d.arch)
    parser.add_argument("--image-size", type=int, default=d.image_size, choices=(32, 64, 96))
    parser.add_argument("--epochs", type=int, default=d.epochs)
    parser.add_argument("--train-samples", type=int, default=d.train_samples)
    parser.add_argument("--val-samples", type=int, default=d.val_samples)
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output stem (default checkpoints/<arch>_signs<size>)")
    parser.add_argument("--half", action="store_true",
                        help="store float16 weights (half the size; accuracy re-measured)")
    parser.add_argument("--no-progress", action="store_true")


def halve_checkpoint(card_path: Path, cfg: TrainConfig) -> ModelCard:
    """Rewrite the card's checkpoint with float16 floating tensors and re-measure the clean
    accuracy on the same held-out signs as `train_source` (seed + 10000)."""
    card_path = Path(card_path)
    model, card = load_source(card_path)
    ckpt = card_path.parent / card.checkpoint
    state = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    torch.save(state, ckpt)
    model, card = load_source(card_path)
    val = make_signs(cfg.val_samples, cfg.image_size, seed=cfg.seed + 10_000)
    x = images_to_tensor(val.images, card.mean, card.std)
    card.clean_accuracy = accuracy(model, x, torch.from_numpy(val.labels))
    save_card(card, card_path)
    return card


def run(args: argparse.Namespace) -> int:
    for name in ("epochs", "train_samples", "val_samples", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    cfg = TrainConfig(arch=args.arch, image_size=args.image_size, epochs=args.epochs,
                      train_samples=args.train_samples, val_samples=args.val_samples,
                      batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      threads=args.threads)
    out = args.out or Path("checkpoints") / f"{args.arch}_signs{args.image_size}"
    t0 = time.perf_counter()
    card = train_source(cfg, out, progress=not args.no_progress)
    if args.half:
        fp32 = card.clean_accuracy
        card = halve_checkpoint(out.with_suffix(".json"), cfg)
        print(f"float16 weights: clean accuracy {fp32:.4f} -> {card.clean_accuracy:.4f}")
    print(f"clean accuracy {card.clean_accuracy:.4f} after {cfg.epochs} epochs "
          f"({time.perf_counter() - t0:.0f} s); wrote {out.with_suffix('.pt')} and "
          f"{out.with_suffix('.json')}")
    return 0

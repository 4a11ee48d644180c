"""`tta train-source`: train the source model on clean synthetic signs (CPU, minutes), or
on a folder's clean splits with `--data cifar10c:DIR` (what `tta make-benchmark` writes).

Every epoch saves the training state next to the output (`<out>.train.safetensors`); the
same command run again resumes after the last finished epoch.

`--safetensors` stores the weights as `<out>.safetensors` (no pickle at all) instead of a
torch file; `--half` stores them as float16 (half the file, for checkpoints shipped in
git). Either loads into the float32 model unchanged (`load_state_dict` casts), and with
`--half` the card's clean accuracy is measured again with the rounded weights.

`--task segmentation --data cityscapes:DIR` trains a segmentation net (tta_core.eval.
seg_train; default arch lraspp_mobilenet_v3_large, batch 8, AdamW lr 2e-3 where --arch,
--batch-size and --lr are left at their classification defaults) on DIR's train split,
writes float16 `<out>.safetensors` and a card with task segmentation whose clean_accuracy
is the val mIoU; it is resumable the same way and rewrites the card after every epoch.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tta_core.cli.choices import ARCHS, SEG_ARCHS

if TYPE_CHECKING:
    from tta_core.model.source import ModelCard, TrainConfig

NAME = "train-source"
HELP = "train the source model (synthetic signs or --data cifar10c:DIR); write checkpoint + card"
# TrainConfig's defaults of the options below (tta_core.model.source imports torch);
# test/system/test_cli_fast.py checks that they are equal
DEFAULTS: dict[str, object] = {"arch": "small_resnet", "image_size": 32, "epochs": 6,
                               "train_samples": 8000, "val_samples": 1000, "batch_size": 128,
                               "lr": 0.05, "seed": 0, "threads": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training options (TrainConfig's defaults) and how to store the weights."""
    d = argparse.Namespace(**DEFAULTS)
    parser.add_argument("--task", choices=("classification", "segmentation"),
                        default="classification",
                        help="segmentation: train on cityscapes:DIR masks (module doc)")
    parser.add_argument("--arch", choices=ARCHS + SEG_ARCHS, default=d.arch)
    parser.add_argument("--image-size", type=int, default=d.image_size, choices=(32, 64, 96))
    parser.add_argument("--epochs", type=int, default=d.epochs)
    parser.add_argument("--data", default="",
                        help="cifar10c:DIR: train on DIR/train.npy, measure on DIR/test.npy "
                             "(default: the built-in synthetic signs)")
    parser.add_argument("--train-samples", type=int, default=None,
                        help=f"training images (default {d.train_samples}; with --data all)")
    parser.add_argument("--val-samples", type=int, default=None,
                        help=f"held-out images (default {d.val_samples}; with --data all)")
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=d.threads, help="torch threads (0: default)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output stem (default checkpoints/<arch>_signs<size>)")
    parser.add_argument("--half", action="store_true",
                        help="store float16 weights (half the size; accuracy re-measured)")
    parser.add_argument("--safetensors", action="store_true",
                        help="write <out>.safetensors instead of a torch file <out>.pt")
    parser.add_argument("--no-progress", action="store_true")


def rewrite_checkpoint(card_path: Path, cfg: TrainConfig, half: bool,
                       to_safetensors: bool) -> ModelCard:
    """Rewrite the card's checkpoint: float16 floating tensors when `half`, as a
    `.safetensors` file (the torch file removed) when `to_safetensors`. With `half` the clean
    accuracy is measured again on the held-out split of `train_source`."""
    import safetensors.torch
    import torch

    from tta_core.data.preprocess import images_to_tensor
    from tta_core.model.source import accuracy, load_source, save_card, training_data
    from tta_core.model.weights import SAFETENSORS_SUFFIX

    card_path = Path(card_path)
    model, card = load_source(card_path)
    old = card_path.parent / card.checkpoint
    state = {k: (v.half() if half and v.is_floating_point() else v).detach().clone()
             for k, v in model.state_dict().items()}
    if to_safetensors:
        new = old.with_suffix(SAFETENSORS_SUFFIX)
        safetensors.torch.save_file(state, str(new), metadata={"card": card_path.name})
        card.checkpoint = new.name
        if old != new:
            old.unlink()
    else:
        torch.save(state, old)
    save_card(card, card_path)
    if half:
        model, card = load_source(card_path)
        *_, val_images, val_labels, _names = training_data(cfg)
        x = images_to_tensor(val_images, card.mean, card.std)
        card.clean_accuracy = accuracy(model, x, torch.from_numpy(val_labels))
        save_card(card, card_path)
    return card


def _segmentation(args: argparse.Namespace) -> int:
    """--task segmentation: train, print the val mIoU and the files."""
    from tta_core.eval.seg_train import SegTrainConfig, train_segmentation

    seg = SegTrainConfig()
    cfg = SegTrainConfig(
        data=args.data, arch=seg.arch if args.arch == DEFAULTS["arch"] else args.arch,
        epochs=args.epochs, train_samples=args.train_samples or 0,
        val_samples=args.val_samples or 0,
        batch_size=seg.batch_size if args.batch_size == DEFAULTS["batch_size"] else args.batch_size,
        lr=seg.lr if args.lr == DEFAULTS["lr"] else args.lr, seed=args.seed, threads=args.threads)
    out = args.out or Path("checkpoints") / f"{cfg.arch}_scenes"
    t0 = time.perf_counter()
    card = train_segmentation(cfg, out, progress=not args.no_progress, log=print)
    print(f"val mIoU {card.clean_accuracy:.4f} after {cfg.epochs} epochs "
          f"({time.perf_counter() - t0:.0f} s); wrote {out.parent / card.checkpoint} and "
          f"{out.with_suffix('.json')}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Train, optionally rewrite the checkpoint, print the clean accuracy and files."""
    from tta_core.model.source import TrainConfig, train_source

    if args.task == "segmentation":
        return _segmentation(args)

    for name in ("train_samples", "val_samples"):  # with --data: all rows unless given
        if getattr(args, name) is None:
            setattr(args, name, 0 if args.data else DEFAULTS[name])
        elif getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    cfg = TrainConfig(arch=args.arch, image_size=args.image_size, epochs=args.epochs,
                      train_samples=args.train_samples, val_samples=args.val_samples,
                      batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      threads=args.threads, data=args.data)
    out = args.out or Path("checkpoints") / f"{args.arch}_signs{args.image_size}"
    t0 = time.perf_counter()
    card = train_source(cfg, out, progress=not args.no_progress, log=print)
    if args.half or args.safetensors:
        fp32 = card.clean_accuracy
        card = rewrite_checkpoint(out.with_suffix(".json"), cfg, args.half, args.safetensors)
        if args.half:
            print(f"float16 weights: clean accuracy {fp32:.4f} -> {card.clean_accuracy:.4f}")
    print(f"clean accuracy {card.clean_accuracy:.4f} after {cfg.epochs} epochs "
          f"({time.perf_counter() - t0:.0f} s); wrote {out.parent / card.checkpoint} and "
          f"{out.with_suffix('.json')}")
    return 0

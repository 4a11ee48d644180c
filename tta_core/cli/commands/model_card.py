"""`tta model-card`: describe your own model and weights with a model card, the file the
bench (`--model-card`), the replay and the perception node load a source model from."""

from __future__ import annotations

import argparse
from pathlib import Path

from tta_core.cli.model_args import add_model_arguments, user_model

NAME = "model-card"
HELP = ("write a model card for your model (torchvision arch or factory) and state_dict: "
        "input size, normalisation, classes")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model options, the card's name and path, --no-check."""
    add_model_arguments(parser, "the model")
    parser.add_argument("--name", default="", help="model name shown in reports and topics "
                                                   "(default <arch>_<weights file stem>)")
    parser.add_argument("--out", type=Path, default=None, metavar="CARD.json",
                        help="card path (default: the weights file with .json); the "
                             "checkpoint is recorded relative to the card when it is in the "
                             "card's folder, else absolute")
    parser.add_argument("--task", choices=("classification", "segmentation"),
                        default="classification",
                        help="segmentation: the model outputs N x C x H x W logits (or "
                             "torchvision's {'out': ...}); checked at the input size")
    parser.add_argument("--no-check", action="store_true",
                        help="skip building the model, loading the weights and one forward "
                             "at the input size (the check names mismatching keys)")


def run(args: argparse.Namespace) -> int:
    """Write (and unless --no-check, try) the card of the given model."""
    from tta_core.model.source import save_card
    from tta_core.model.user_card import check_card_model, make_card

    um = user_model(args, name=args.name)
    if um is None:
        raise ValueError("--model ARCH|package.module:function is required")
    out = args.out or um.weights.with_suffix(".json")
    if out.resolve() == um.weights.resolve():
        raise ValueError(f"--out {out} is the weights file itself")
    card = make_card(um, out.parent)
    if not args.no_check:
        check_card_model(card, out.parent)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_card(card, out)
    checked = "" if args.no_check else "; weights loaded and run once"
    print(f"wrote {out} ({card.arch}, {card.num_classes} classes, {card.image_size} px, "
          f"checkpoint {card.checkpoint}{checked})")
    return 0

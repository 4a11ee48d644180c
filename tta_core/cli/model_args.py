"""Command-line options that describe a user's model (`tta bench`, `tta model-card`):
architecture or factory, weights, input size, normalisation, classes, builder kwargs.

Light at import (no torch): `tta <cmd> --help` builds these options; the model code
(tta_core.model.user_card) is imported only when the parsed options are turned into a model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tta_core.model.user_card import UserModel

CLASS_PRESETS = ("cifar10",)
# the keys of tta_core.model.user_card.NORM_PRESETS (which imports torch); a test keeps them equal
NORM_NAMES: tuple[str, ...] = ("imagenet", "cifar10", "none")


def _triple(text: str) -> tuple[float, ...]:
    """'0.49,0.48,0.45' -> three floats."""
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected 3 comma-separated numbers R,G,B, got "
                                         f"{text!r}")
    return values


def _kwargs(text: str) -> dict:
    """A JSON object of builder keyword arguments."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--model-kwargs {text!r} is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--model-kwargs {text!r} is not a JSON object")
    return value


def class_names(text: str) -> tuple[str, ...]:
    """'a,b,c', '@FILE' (one name a line) or a preset ('cifar10') -> class names."""
    if text in CLASS_PRESETS:
        from tta_core.data.loaders import CIFAR10_CLASSES

        return CIFAR10_CLASSES
    if text.startswith("@"):
        path = Path(text[1:])
        if not path.is_file():
            raise FileNotFoundError(f"--class-names file {str(path)!r} not found")
        names = tuple(n.strip() for n in path.read_text().splitlines() if n.strip())
    else:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
    if len(names) < 2 or len(set(names)) != len(names):
        raise ValueError(f"--class-names {text!r}: need >= 2 distinct names, got "
                         f"{len(names)} ({len(set(names))} distinct)")
    return names


def add_model_arguments(parser: argparse.ArgumentParser, title: str) -> None:
    """The options of a user's model, in their own help group."""
    g = parser.add_argument_group(title, "a model of your own: a torchvision classifier by "
                                  "name or your factory, its state_dict, and how it reads "
                                  "images (given explicitly: no 224 px / ImageNet default)")
    g.add_argument("--model", metavar="ARCH|package.module:function", default=None,
                   help="torchvision model name (resnet18, efficientnet_b0, ...; built with "
                        "random init and --num-classes outputs) or your factory, called "
                        "with --model-kwargs (plus num_classes when it takes one), e.g. "
                        "mymodels.cifar:resnet20 (a CIFAR-style variant)")
    g.add_argument("--weights", type=Path, metavar="FILE",
                   help="state_dict: a torch file (read with torch.load(weights_only=True)) "
                        "or .safetensors")
    g.add_argument("--input-size", type=int, default=0, metavar="PX",
                   help="input size in pixels the model was trained at (e.g. 32, 224)")
    g.add_argument("--norm", choices=NORM_NAMES,
                   help="normalisation preset: imagenet, cifar10 mean/std, or none ([0, 1])")
    g.add_argument("--mean", type=_triple, metavar="R,G,B",
                   help="per-channel mean in [0, 1] pixel units (with --std)")
    g.add_argument("--std", type=_triple, metavar="R,G,B", help="per-channel std")
    g.add_argument("--num-classes", type=int, default=0, metavar="N",
                   help="outputs of the model (default: the number of --class-names, "
                        "else of the data's classes)")
    g.add_argument("--class-names", default="", metavar="A,B,...|@FILE|cifar10",
                   help="class names in output order: a comma list, a file with one name a "
                        "line, or cifar10")
    g.add_argument("--model-kwargs", type=_kwargs, default={}, metavar="JSON",
                   help='builder keyword arguments, e.g. \'{"depth": 20}\' or, for '
                        'torchvision vit_b_16 at 32 px, \'{"image_size": 32}\'')


def user_model(args: argparse.Namespace, name: str = "") -> UserModel | None:
    """The UserModel of the parsed options; None when --model is not given (ValueError
    when other model options are)."""
    from tta_core.model.user_card import NORM_PRESETS, UserModel

    given = [f"--{k.replace('_', '-')}" for k in ("weights", "input_size", "norm", "mean",
                                                 "std", "num_classes", "class_names",
                                                 "model_kwargs") if getattr(args, k)]
    if args.model is None:
        if given:
            raise ValueError(f"{', '.join(given)} describe a model: give --model ARCH too")
        return None
    if args.weights is None:
        raise ValueError(f"--model {args.model} needs --weights FILE (its state_dict: random "
                         "weights are not a source model)")
    if args.norm and (args.mean or args.std):
        raise ValueError(f"--norm {args.norm} and --mean/--std both given: give one")
    if bool(args.mean) != bool(args.std):
        raise ValueError("--mean and --std go together")
    mean, std = NORM_PRESETS[args.norm] if args.norm else (args.mean or (), args.std or ())
    return UserModel(model=args.model, weights=args.weights, input_size=args.input_size,
                     mean=tuple(mean), std=tuple(std), num_classes=args.num_classes,
                     class_names=class_names(args.class_names) if args.class_names else (),
                     kwargs=dict(args.model_kwargs), name=name,
                     task=getattr(args, "task", None) or "classification")

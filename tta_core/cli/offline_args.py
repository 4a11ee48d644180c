"""Command-line options of the offline phases' data (`tta prepare`, `tta train-elastic`,
`tta train-corruption-encoder`, `tta train-darda`): which clean labelled images, and the
corruptions the phases that need labelled corrupted images make from them.

Light at import (no numpy, no torch): `tta <cmd> --help` builds these options; the images
are read by tta_core.cli.offline_inputs inside a command's run().
"""

from __future__ import annotations

import argparse

# tta_core.data.corruptions.HELD_OUT (that package imports numpy); a test keeps them equal
HELD_OUT: tuple[str, ...] = ("speckle_noise", "gaussian_blur", "spatter", "saturate")
DATA_HELP = ("your clean labelled images: folder:DIR (DIR/<domain>/<class>/*.png|jpg, e.g. "
             "one domain 'clean'), cifar10c:DIR (train.npy + train_labels.npy, as `tta "
             "make-benchmark` writes), bag:DIR (a rosbag2 with /ground_truth) or signs (the "
             "built-in synthetic signs); resized to the card's input size, classes matched "
             "to the card's by name. Labelled corrupted images are made from them with the "
             "corruption library")


def _names(text: str) -> tuple[str, ...]:
    return tuple(c.strip() for c in text.split(",") if c.strip())


def add_offline_data(parser: argparse.ArgumentParser, default: str = "signs",
                     corruptions: bool = True, data: bool = True) -> None:
    """--data (unless `data` is False: the command has its own) and, with `corruptions`,
    --corruptions and --held-out."""
    if data:
        parser.add_argument("--data", default=default, metavar="KIND:DIR|signs",
                            help=DATA_HELP)
    if corruptions:
        parser.add_argument("--corruptions", type=_names, default=(), metavar="A,B,...",
                            help="corruptions the labelled corrupted images are made with "
                                 "(default: the 15 standard ones), less --held-out")
        parser.add_argument("--held-out", type=_names, default=HELD_OUT, metavar="A,B,...",
                            help="corruptions never used offline (default: "
                                 f"{','.join(HELD_OUT)}: the evaluation's unseen ones; "
                                 "DARDA refuses these four offline in any case)")


def data_given(args: argparse.Namespace) -> bool:
    """Whether --data names the user's images rather than the signs' default route."""
    return bool(args.data) and args.data != "signs"

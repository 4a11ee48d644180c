"""`tta train-darda`: DARDA's offline phase (tta_core.darda.offline) for a model card:
one sub-network per training corruption, the corruption extractor and encoder, the
accuracy matrix and the sub-network encoder S, saved as one safetensors bundle next to
the card (the darda method's `bundle_path`).

The labelled images are the built-in signs rendered under the training corruptions
(default), or `--data cifar10c:DIR`: the folder's `<corruption>.npy` of the 15 standard
corruptions at `--severity` (tta_core.darda.offline_data; the held-out ones are never
read), resized to the card's input size and normalised with its mean / std. With
`--data folder:DIR` or `bag:DIR` (your own clean labelled images, e.g. for a card of `tta
model-card`) the labelled corrupted images are made from them by the corruption library
(tta_core.cli.offline_inputs.darda_data): `--samples` fitting and `--eval-samples` other
images per training corruption (`--corruptions` less `--held-out`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tta_core.cli.offline_args import add_offline_data

NAME = "train-darda"
HELP = "DARDA offline phase: per-corruption sub-networks, encoders, S (one bundle file)"
DEFAULT_CARD = Path("checkpoints") / "small_resnet_signs32.json"
# fields of tta_core.darda.offline.OfflineConfig settable here, with their defaults (that
# module imports torch)
OFFLINE_DEFAULTS: dict[str, int | float | str] = {
    "samples": 256, "eval_samples": 128, "severity": 5, "seed": 101, "epochs": 10,
    "batch": 32, "lr": 5e-3, "noise_count": 4, "noise_seed": 7, "s_hidden": 64,
    "s_steps": 800, "s_lr": 5e-3, "lambda_r": 0.5, "encoder_steps": 200, "threads": 2,
    "cm_pairs": "diagonal", "probe_batch": 64}
CM_PAIRS = ("diagonal", "off_diagonal")  # tta_core.darda.subnet.PAIRS
FOLDER_SAMPLES = 2000  # --samples with --data when not given (fewer if the folder is smaller)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The card, the data, the output bundle, an encoder to reuse, the offline settings."""
    parser.add_argument("--model-card", type=Path, default=DEFAULT_CARD)
    parser.add_argument("--data", default="", metavar="KIND:DIR",
                        help="cifar10c:DIR: fit on DIR/<corruption>.npy of the 15 training "
                             "corruptions; folder:DIR or bag:DIR: your clean labelled images, "
                             "corrupted here (default: render the built-in signs)")
    add_offline_data(parser, data=False)
    parser.add_argument("--out", type=Path, default=None,
                        help="bundle file (default: <card stem>_darda.safetensors next to "
                             "the card)")
    parser.add_argument("--encoder", type=Path, default=None,
                        help="reuse this corruption encoder (tta train-corruption-encoder) "
                             "instead of training one")
    parser.add_argument("--encoders-from", type=Path, default=None,
                        help="reuse both corruption encoders of this bundle (same model)")
    for name, default in OFFLINE_DEFAULTS.items():
        flag = f"--{name.replace('_', '-')}"
        if name == "samples":
            parser.add_argument(flag, type=int, default=None,
                                help=f"labelled images per training corruption (default "
                                     f"{default} rendered; with --data {FOLDER_SAMPLES}, or "
                                     "fewer if the folder holds fewer rows besides "
                                     "--eval-samples)")
        elif name == "cm_pairs":
            parser.add_argument(flag, choices=CM_PAIRS, default=default,
                                help="Eq. 9's pairs: i = j, or i != j as printed (which "
                                     "Eq. 10's pick over the signatures does not suit)")
        elif name == "probe_batch":
            parser.add_argument(flag, type=int, default=default,
                                help="evaluation images per batch of the Eq. 16 probe (loss "
                                     "and gradient norm at the picked sub-network)")
        else:
            parser.add_argument(flag, type=type(default), default=default)


def _samples(args: argparse.Namespace, root: Path | None, corruptions: tuple[str, ...]) -> int:
    """--samples, or its default for the data (the --samples help)."""
    if args.samples is not None:
        return args.samples
    if root is None:
        return int(OFFLINE_DEFAULTS["samples"])
    from tta_core.darda.offline_data import folder_samples

    return folder_samples(root, corruptions, args.eval_samples, FOLDER_SAMPLES)


def run(args: argparse.Namespace) -> int:
    """Run the offline phase, save the bundle and print its summary and what it records."""
    from tta_core.darda.bundle import load_bundle, save_bundle
    from tta_core.darda.offline import OfflineConfig, run_offline
    from tta_core.darda.offline_data import folder_data
    from tta_core.data.sources import parse_data, training_corruptions
    from tta_core.domain.encoder import load_encoder
    from tta_core.errors import InputError
    from tta_core.model.source import find_card, load_source

    root, own = None, False
    if args.data:
        spec = parse_data(args.data)
        if spec.kind not in ("cifar10c", "folder", "bag"):
            raise InputError(f"--data {args.data!r}: train-darda reads cifar10c:DIR, "
                             "folder:DIR or bag:DIR")
        root, own = (spec.root, False) if spec.kind == "cifar10c" else (None, True)
    args.model_card = find_card(args.model_card)  # the bundle goes next to it
    model, card = load_source(args.model_card)
    values = {name: getattr(args, name) for name in OFFLINE_DEFAULTS}
    corruptions = training_corruptions(args.corruptions, args.held_out)
    values["samples"] = _samples(args, root, corruptions)
    cfg = OfflineConfig(corruptions=corruptions, **values)
    cfg.validate()
    enc = load_encoder(args.encoder) if args.encoder else None
    raw = None
    if args.encoders_from:
        prev = load_bundle(args.encoders_from, model)
        enc, raw = prev.encoder, prev.raw_encoder
    data = None
    if own:
        from tta_core.cli.offline_inputs import darda_data, labelled_images

        data = darda_data(labelled_images(args.data, card, 0, cfg.seed), cfg.corruptions,
                          cfg.samples, cfg.eval_samples, cfg.severity, cfg.seed, card)
    elif root is not None:
        data = folder_data(root, cfg.corruptions, cfg.samples, cfg.eval_samples, cfg.severity,
                           card.image_size, tuple(card.mean), tuple(card.std),
                           tuple(card.class_names))
    off = run_offline(model, card.image_size, tuple(card.mean), tuple(card.std), cfg, enc,
                      log=True, raw_encoder=raw, data=data)
    off.report["card"] = card.name
    out = args.out or args.model_card.with_name(f"{args.model_card.stem}_darda.safetensors")
    save_bundle(off, model, out)
    back = load_bundle(out, model)
    acc, eq16 = back.accuracy, back.report["s"]["eq16"]
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB) in {off.report['seconds']:.0f} s:"
          f" own-corruption accuracy {float(acc.diagonal().mean()):.3f} (source "
          f"{sum(off.report['source_accuracy']) / len(acc):.3f}), S picks the own sub-network "
          f"for {off.report['s']['own_pick']:.2f} of the corruptions; Eq. 16 at the pick: "
          f"loss {eq16['loss']:.4f} (floor {eq16['floor']:.4f}), gradient norm "
          f"{eq16['grad_norm']:.3g}")
    print("offline config: " + json.dumps(back.config, sort_keys=True))
    print("data: " + json.dumps(back.data, sort_keys=True))
    return 0

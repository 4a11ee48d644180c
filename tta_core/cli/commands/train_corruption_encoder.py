"""`tta train-corruption-encoder`: train DARDA's corruption extractor and contrastive
encoder (§4.1-4.2; network tta_core.domain.encoder, training tta_core.darda.encoder) on
the synthetic signs under the 15 corruptions, and save it as safetensors for the domain
embedding (darda `encoder_path`, `EmbeddingConfig.encoder`).

`--data KIND:DIR` makes the images from your own clean labelled images instead (resized to
the card's input size): `--samples` of them under each training corruption (`--corruptions`
less `--held-out`, at `--severity`, the corruption library)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tta_core.cli.offline_args import add_offline_data, data_given

NAME = "train-corruption-encoder"
HELP = "train DARDA's corruption encoder (SupCon + Noise2Noise extractor) on the 15 corruptions"
DEFAULT_CARD = Path("checkpoints") / "small_resnet_signs32.json"
# every field of tta_core.domain.encoder.EncoderConfig with its default, in order (that
# module imports torch); one option each. test/system/test_cli_fast.py checks they are equal
ENCODER_DEFAULTS: dict[str, int | float] = {
    "channels": 3, "width": 16, "dim": 32, "tau": 0.1, "lambda_e": 1.0, "steps": 200,
    "per_class": 8, "lr": 2e-3, "samples": 256, "severity": 5, "seed": 11, "threads": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The card, the output file and one option per EncoderConfig field."""
    parser.add_argument("--model-card", type=Path, default=DEFAULT_CARD,
                        help="the card whose input normalisation the encoder sees")
    add_offline_data(parser)
    parser.add_argument("--out", type=Path, default=Path("corruption_encoder.safetensors"))
    for name, default in ENCODER_DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--log-every", type=int, default=50, help="0: quiet")


def run(args: argparse.Namespace) -> int:
    """Train the encoder, save it and print its losses."""
    from tta_core.darda.encoder import train_encoder
    from tta_core.domain.encoder import EncoderConfig, save_encoder
    from tta_core.model.source import find_card, load_card

    card = load_card(find_card(args.model_card))
    cfg = EncoderConfig(**{name: getattr(args, name) for name in ENCODER_DEFAULTS})
    data = None
    if data_given(args):
        from tta_core.cli.offline_inputs import encoder_data, labelled_images
        from tta_core.data.sources import training_corruptions

        li = labelled_images(args.data, card, 0, cfg.seed)
        data = encoder_data(li, training_corruptions(args.corruptions, args.held_out),
                            cfg.samples, cfg.severity, cfg.seed, card)
    enc, rep = train_encoder(cfg, tuple(card.mean), tuple(card.std), args.log_every,
                             data=data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_encoder(enc, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KiB) after {cfg.steps} steps in "
          f"{rep['seconds']:.0f} s: SupCon {rep['first_supcon']:.3f} -> {rep['supcon']:.3f}, "
          f"L_N {rep['noise']:.4f}")
    return 0

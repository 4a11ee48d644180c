"""`tta train-corruption-encoder`: train DARDA's corruption extractor and contrastive
encoder (§4.1-4.2, tta_core.darda.encoder) on the synthetic signs under the 15
corruptions, and save it as safetensors for the domain embedding (darda `encoder_path`,
`EmbeddingConfig.encoder`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from tta_core.darda.encoder import EncoderConfig, save_encoder, train_encoder
from tta_core.model.source import load_card

NAME = "train-corruption-encoder"
HELP = "train DARDA's corruption encoder (SupCon + Noise2Noise extractor) on the 15 corruptions"
DEFAULT_CARD = Path("checkpoints") / "small_resnet_signs32.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EncoderConfig()
    parser.add_argument("--model-card", type=Path, default=DEFAULT_CARD,
                        help="the card whose input normalisation the encoder sees")
    parser.add_argument("--out", type=Path, default=Path("corruption_encoder.safetensors"))
    for f in dataclasses.fields(EncoderConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(d, f.name)),
                            default=getattr(d, f.name))
    parser.add_argument("--log-every", type=int, default=50, help="0: quiet")


def run(args: argparse.Namespace) -> int:
    card = load_card(args.model_card)
    cfg = EncoderConfig(**{f.name: getattr(args, f.name)
                           for f in dataclasses.fields(EncoderConfig)})
    enc, rep = train_encoder(cfg, tuple(card.mean), tuple(card.std), args.log_every)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_encoder(enc, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 1024:.0f} KiB) after {cfg.steps} steps in "
          f"{rep['seconds']:.0f} s: SupCon {rep['first_supcon']:.3f} -> {rep['supcon']:.3f}, "
          f"L_N {rep['noise']:.4f}")
    return 0

"""`tta train-darda`: DARDA's offline phase (tta_core.darda.offline) for a model card:
one sub-network per training corruption, the corruption extractor and encoder, the
accuracy matrix and the sub-network encoder S, saved as one safetensors bundle next to
the card (the darda method's `bundle_path`)."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "train-darda"
HELP = "DARDA offline phase: per-corruption sub-networks, encoders, S (one bundle file)"
DEFAULT_CARD = Path("checkpoints") / "small_resnet_signs32.json"
# fields of tta_core.darda.offline.OfflineConfig settable here, with their defaults (that
# module imports torch)
OFFLINE_DEFAULTS: dict[str, int | float] = {
    "samples": 256, "eval_samples": 128, "severity": 5, "seed": 101, "epochs": 10,
    "batch": 32, "lr": 5e-3, "noise_count": 4, "noise_seed": 7, "s_hidden": 64,
    "s_steps": 800, "s_lr": 5e-3, "lambda_r": 0.5, "encoder_steps": 200, "threads": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The card, the output bundle, an encoder to reuse, and the offline settings."""
    parser.add_argument("--model-card", type=Path, default=DEFAULT_CARD)
    parser.add_argument("--out", type=Path, default=None,
                        help="bundle file (default: <card stem>_darda.safetensors next to "
                             "the card)")
    parser.add_argument("--encoder", type=Path, default=None,
                        help="reuse this corruption encoder (tta train-corruption-encoder) "
                             "instead of training one")
    parser.add_argument("--encoders-from", type=Path, default=None,
                        help="reuse both corruption encoders of this bundle (same model)")
    for name, default in OFFLINE_DEFAULTS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)


def run(args: argparse.Namespace) -> int:
    """Run the offline phase, save the bundle and print its summary."""
    from tta_core.darda.bundle import load_bundle, save_bundle
    from tta_core.darda.encoder import load_encoder
    from tta_core.darda.offline import OfflineConfig, run_offline
    from tta_core.model.source import load_source

    model, card = load_source(args.model_card)
    cfg = OfflineConfig(**{name: getattr(args, name) for name in OFFLINE_DEFAULTS})
    enc = load_encoder(args.encoder) if args.encoder else None
    raw = None
    if args.encoders_from:
        prev = load_bundle(args.encoders_from, model)
        enc, raw = prev.encoder, prev.raw_encoder
    off = run_offline(model, card.image_size, tuple(card.mean), tuple(card.std), cfg, enc,
                      log=True, raw_encoder=raw)
    off.report["card"] = card.name
    out = args.out or args.model_card.with_name(f"{args.model_card.stem}_darda.safetensors")
    save_bundle(off, model, out)
    acc = off.accuracy
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB) in {off.report['seconds']:.0f} s:"
          f" own-corruption accuracy {float(acc.diagonal().mean()):.3f} (source "
          f"{sum(off.report['source_accuracy']) / len(acc):.3f}), S picks the own sub-network "
          f"for {off.report['s']['own_pick']:.2f} of the corruptions")
    return 0

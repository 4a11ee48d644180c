"""`tta prepare`: every offline artifact of your model and data for the methods that need
one, in one resumable run, plus a vehicle parameters file that uses them.

Steps, by method (tta_core.cli.prepare_steps):
- adashadow: `profile` (per-unit latencies, `tta profile --model-card --data`) ->
  profile.json; `calibrate` (the device constants timed on your model's forward, `tta
  calibrate --model-card --data`) -> calibration.json; both on a batch of your images;
- darda: `encoder` (the corruption encoder, `tta train-corruption-encoder --data`) ->
  corruption_encoder.safetensors; `darda` (the offline bundle, `tta train-darda --data`,
  reusing that encoder) -> darda.safetensors;
- elastic: `elastic` (the gated master, `tta train-elastic --data`) -> elastic.json +
  elastic.safetensors;
- always: `vehicle` -> vehicle.yaml (config/vehicle.yaml's sections, the first method's
  perception, the artifacts as its options; the other methods' options as comments).

The labelled corrupted images of DARDA's sub-networks, its encoders and ElasticDNN's
pre-training are made from your clean labelled images (`--data`) by the corruption
library, over `--corruptions` less `--held-out`. `--set STEP.KEY=VALUE` sets a step's
option (the fields of its config: e.g. darda.samples=64, elastic.stage_epochs=1,
profile.repeats=3, calibrate.quick=true).

Resumable: out/manifest.json records, per step, a key over what it was built from (the
card and weights bytes, the data listing, its options, the files of the steps it reads)
and the SHA-256 of each file it wrote. A step whose key matches and whose files are all
present with those checksums is skipped; a step is built into out/.partial/ and moved into
place before the manifest names it, so a killed run continues at the step it was in.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tta_core.cli.commands.bench import _option
from tta_core.cli.offline_args import add_offline_data

NAME = "prepare"
HELP = ("every offline artifact of your model and data (profile, calibration, DARDA bundle, "
        "gated master, corruption encoder) and a vehicle params file; resumable")
METHODS: tuple[str, ...] = ("adashadow", "darda", "elastic")
# the steps each method needs, in build order (tta_core.cli.prepare_steps builds them)
STEPS: dict[str, tuple[str, ...]] = {"adashadow": ("profile", "calibrate"),
                                     "darda": ("encoder", "darda"), "elastic": ("elastic",)}


def _methods(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"--methods {text!r}: choose from {','.join(METHODS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The card, the data, the methods, the output folder and the step options."""
    parser.add_argument("--model-card", type=Path, required=True,
                        help="your model's card (`tta model-card`)")
    add_offline_data(parser)
    parser.add_argument("--severity", type=int, default=5, choices=range(1, 6),
                        help="severity of the labelled corrupted images")
    parser.add_argument("--methods", type=_methods, default=METHODS, metavar="A,B,...",
                        help=f"methods to prepare for (default {','.join(METHODS)})")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--set", type=_option, action="append", default=[], dest="options",
                        metavar="STEP.KEY=VALUE",
                        help="a step's option (profile, calibrate, encoder, darda, elastic: "
                             "the fields of its config), e.g. darda.epochs=5 (repeatable)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every step")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    """Build (or skip) every step and print what was done and how to bench the result."""
    from tta_core.cli.prepare_steps import prepare

    steps = (*(s for m in args.methods for s in STEPS[m]), "vehicle")
    options: dict[str, dict] = {}
    for step, key, value in args.options:
        if step not in steps:
            raise ValueError(f"--set {step}.{key}: {step!r} is not a step of --methods "
                             f"{','.join(args.methods)} ({', '.join(steps)})")
        options.setdefault(step, {})[key] = value
    result = prepare(args, steps, options)
    for name, state in result.states.items():
        print(f"{name}: {state}")
    sets = " ".join(f"--set {m}.{k}={v}" for m, o in result.method_options.items()
                    for k, v in o.items())
    print(f"wrote {args.out / 'manifest.json'} and {args.out / 'vehicle.yaml'}; bench with: "
          f"tta bench --model-card {args.model_card} --methods bn_adapt,"
          f"{','.join(args.methods)} {sets}")
    return 0

"""`tta profile`: measure the offline per-unit latency profile of a model on this device: a
model-zoo arch (`--arch`) or your own model's card (`--model-card`). The profile holds
times, not data: the timed batch is random at the model's input size, or with `--data` the
first `--batch-size` of your clean images (as the card normalises them)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tta_core.cli.choices import ARCHS, SPLITS
from tta_core.io.strict_json import dumps as json_dumps

NAME = "profile"
HELP = "measure per-unit forward/backward latency (AdaShadow offline profile) to JSON"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, batch, repeats, split, device, threads and output path."""
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--arch", choices=ARCHS, help="a model-zoo architecture (random weights)")
    model.add_argument("--model-card", type=Path, default=None,
                       help="your model's card (`tta model-card`): its model, weights and "
                            "input size (--image-size and --num-classes then unused)")
    parser.add_argument("--data", default=None, metavar="KIND:DIR",
                        help="time on a batch of your clean images (with --model-card; "
                             "folder:DIR, cifar10c:DIR, bag:DIR or signs) instead of a "
                             "random one")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5,
                        help="median over this many timed runs (with --split plans each "
                             "repeat also times 2N sparse backwards; fewer repeats, noisier "
                             "plan costs)")
    parser.add_argument("--split", choices=SPLITS, default="plans",
                        help="how a unit's backward divides into dw and dx: by MACs (paper) "
                             "or fitted to measured sparse-plan backwards (slower, closer; "
                             "see tta_core.adashadow.profiler)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--bn-mode", default="batch", choices=("batch", "source"))
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default config/profiles/<arch>_<device>.json)")


def default_path(arch: str, device: str) -> Path:
    """config/profiles/<arch>_<device>.json with the device name made file-safe."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", device).strip("-").lower()
    return Path("config") / "profiles" / f"{arch}_{safe}.json"


def run(args: argparse.Namespace) -> int:
    """Profile the model and save the JSON; print a summary line (JSON)."""
    import torch

    from tta_core.adashadow.profiler import device_name, profile_model
    from tta_core.model.norms import set_bn_mode
    from tta_core.model.units import decompose
    from tta_core.model.zoo import build_model

    if args.batch_size < 1 or args.image_size < 8 or args.repeats < 1:
        raise ValueError(f"bad sizes: batch {args.batch_size}, image {args.image_size}, "
                         f"repeats {args.repeats}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.data is not None and args.model_card is None:
        raise ValueError(f"--data {args.data} needs --model-card (the card says how the "
                         f"images are sized and normalised)")
    device = torch.device(args.device)
    inputs = None
    if args.model_card is not None:
        from tta_core.model.source import find_card, load_source

        model, card = load_source(find_card(args.model_card), device)
        arch, shape = card.arch, (3, *card.input_hw)
        name = card.name or args.model_card.stem
        if args.data is not None:
            from tta_core.cli.offline_inputs import timed_batch

            inputs = timed_batch(args.data, card, args.batch_size)
    else:
        model = build_model(args.arch, args.num_classes).to(device)
        arch, shape, name = args.arch, (3, args.image_size, args.image_size), args.arch
    set_bn_mode(model, args.bn_mode)
    staged = decompose(model, shape, arch)
    prof = profile_model(staged, batch=args.batch_size, repeats=args.repeats, split=args.split,
                         inputs=inputs)
    out = args.out or default_path(name, device_name(device))
    out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(out)
    print(json_dumps({"out": str(out), "model": prof.model, "device": prof.device,
                      "units": len(prof.unit_names), "forward_ms": round(prof.forward_ms, 3),
                      "sum_r_ms": round(float(prof.r_ms.sum()), 3),
                      "sum_backward_ms": round(float((prof.w_ms + prof.x_ms).sum()), 3)}))
    return 0

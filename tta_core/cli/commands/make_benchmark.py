"""`tta make-benchmark OUT`: write the CIFAR-scale shift benchmark (signs32-C) in the
CIFAR-10-C layout (tta_core.data.benchmark): 50,000 training and 10,000 clean test images
of synthetic signs, and 19 corruptions x 5 severities of the test images. Deterministic by
seed, resumable (run it again after a stop), checked against the published fingerprint.

`tta make-benchmark --scenes [OUT]` writes the segmentation benchmark instead
(tta_core.data.scene_set): synthetic driving scenes with Cityscapes train-id masks in the
Cityscapes layout, and fog/night/rain/snow versions in the ACDC layout (default data/scenes)."""

from __future__ import annotations

import argparse
from pathlib import Path

NAME = "make-benchmark"
HELP = "write the CIFAR-scale shift benchmark (signs32-C) in the CIFAR-10-C layout"
DEFAULT_OUT = Path("data") / "signs32c"
SCENES_OUT = Path("data") / "scenes"
# tta_core.data.scene_set.SceneSetConfig's train, val and per_condition defaults
SCENE_SIZES = "5000,500,500"
# tta_core.data.benchmark.BenchmarkConfig's defaults (test/system/test_cli_fast.py checks)
DEFAULTS: dict[str, int] = {"train": 50_000, "test": 10_000, "per_corruption": 2_000, "seed": 0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """OUT, the sizes, seed, workers; --verify checks a finished folder's bytes."""
    d = argparse.Namespace(**DEFAULTS)
    parser.add_argument("out", type=Path, nargs="?", default=DEFAULT_OUT,
                        help=f"folder to write (default {DEFAULT_OUT})")
    parser.add_argument("--train", type=int, default=d.train, help="clean training images")
    parser.add_argument("--test", type=int, default=d.test, help="clean test images")
    parser.add_argument("--per-corruption", type=int, default=d.per_corruption,
                        help="test images per corruption and severity (CIFAR-10-C: 10000)")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--workers", type=int, default=0, help="processes (0: one per CPU)")
    parser.add_argument("--verify", action="store_true",
                        help="only check a finished folder against its meta.json")
    parser.add_argument("--scenes", action="store_true",
                        help=f"write the driving-scene segmentation benchmark (Cityscapes and "
                             f"ACDC layouts; default OUT {SCENES_OUT}) instead")
    parser.add_argument("--scene-sizes", default=SCENE_SIZES, metavar="TRAIN,VAL,PER_CONDITION",
                        help=f"with --scenes: clean train and val scenes, scenes per "
                             f"condition (default {SCENE_SIZES})")
    parser.add_argument("--no-progress", action="store_true")


def _scenes(args: argparse.Namespace) -> int:
    """--scenes: generate (or keep, or verify) the driving-scene benchmark."""
    from tta_core.data import scene_set as ss

    out = SCENES_OUT if args.out == DEFAULT_OUT else args.out
    if args.verify:
        bad = ss.verify(out)
        print(f"{out}: " + (f"{len(bad)} file(s) differ from meta.json: {', '.join(bad[:5])}"
                            if bad else f"every file matches; fingerprint {ss.fingerprint(out)}"))
        return 1 if bad else 0
    try:
        train, val, per = (int(v) for v in args.scene_sizes.split(","))
        cfg = ss.SceneSetConfig(train=train, val=val, per_condition=per, seed=args.seed)
        cfg.validate()
    except ValueError as exc:
        raise SystemExit(f"tta make-benchmark: --scene-sizes {args.scene_sizes!r}: "
                         f"{exc}") from None
    report = ss.generate(out, cfg, max(args.workers, 1), progress=not args.no_progress)
    what = ("already complete" if report.complete_before else
            f"made {report.made} unit(s), kept {report.kept} in {report.seconds:.0f} s")
    fp = ss.fingerprint(out)
    known = ss.PUBLISHED.get(f"{train}/{val}/{per}/{args.seed}")
    print(f"{out}: {what}; fingerprint {fp}"
          + ("" if known is None else " (the published one)" if known == fp else
             f" (differs from the published {known})"))
    return 0


def run(args: argparse.Namespace) -> int:
    """Generate (or resume, or verify) and print where the time went."""
    from tta_core.data import benchmark as bm

    if args.scenes:
        return _scenes(args)
    if args.verify:
        bad = bm.verify(args.out)
        if bad:
            print(f"{args.out}: {len(bad)} file(s) differ from meta.json: {', '.join(bad)}")
            return 1
        print(f"{args.out}: every file matches meta.json; fingerprint {bm.fingerprint(args.out)}")
        return 0
    cfg = bm.BenchmarkConfig(train=args.train, test=args.test,
                             per_corruption=args.per_corruption, seed=args.seed)
    try:
        cfg.validate()
    except ValueError as exc:
        raise SystemExit(f"tta make-benchmark: {exc}") from None
    if args.workers < 0:
        raise SystemExit(f"--workers must be >= 0, got {args.workers}")
    report = bm.generate(args.out, cfg, args.workers, progress=not args.no_progress)
    slow = sorted(report.seconds_by_file.items(), key=lambda kv: -kv[1])[:4]
    print(f"{args.out}: made {len(report.made)} file(s), kept {len(report.kept)} in "
          f"{report.seconds:.0f} s; worker time by file (top 4): "
          + (", ".join(f"{k} {v:.0f} s" for k, v in slow) or "none"))
    fp = bm.fingerprint(args.out)
    published = bm.PUBLISHED.get(bm.config_key(cfg))
    if published is None:
        print(f"fingerprint {fp} (no published fingerprint for this size and seed)")
    elif published == fp:
        print(f"fingerprint {fp}: the published benchmark, byte for byte")
    else:
        print(f"fingerprint {fp} differs from the published {published} (another numpy, "
              "scipy or imagecorruptions version renders some corruptions differently)")
    return 0

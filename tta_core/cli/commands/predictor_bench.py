"""`tta predictor-bench`: AdaShadow Table 9 on this machine. Error % of the runtime latency
predictor and of the offline-only predictor for a fixed sparse plan's backward, idle and
under competing compute- / memory-bound processes that the command starts and stops."""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tta_core.cli.choices import ARCHS, SPLITS

if TYPE_CHECKING:
    from tqdm import tqdm

    from tta_core.adashadow.predictor import Calibration

NAME = "predictor-bench"
HELP = "runtime vs offline latency predictor error under competing processes (Table 9)"
# copies of tta_core.eval.predictor_bench's CONDITIONS (keys), MODELS and PI2_MODES, which
# import torch; test/system/test_cli_fast.py checks that they are equal
CONDITIONS: tuple[str, ...] = ("offline", "dr2", "dr3", "dr4")
MODELS: tuple[str, ...] = ("share", "paper")
PI2_MODES: tuple[str, ...] = ("probe", "perf")


def _conditions(text: str) -> tuple[str, ...]:
    """'offline,dr2' -> ('offline', 'dr2'); every name one of CONDITIONS."""
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [n for n in names if n not in CONDITIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"--conditions must be a comma list of {','.join(CONDITIONS)}, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, batch, conditions, predictor modes, calibration and profile to reuse."""
    parser.add_argument("--arch", default="resnet50", choices=ARCHS)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--batches", type=int, default=30, help="measured batches per condition")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (also calibration)")
    parser.add_argument("--conditions", type=_conditions, default=CONDITIONS,
                        help="comma list of offline,dr2,dr3,dr4 (default: all)")
    parser.add_argument("--sigma", type=float, default=0.5, help="budget of the fixed plan")
    parser.add_argument("--split", choices=SPLITS, default="plans",
                        help="profiler: dw/dx split of a unit's backward (see `tta profile`)")
    parser.add_argument("--pi2", choices=PI2_MODES, default="probe",
                        help="pi2 without cache counters: probe (DRAM bandwidth probe, a "
                             "deviation from the paper) or perf (hit rate only, else 1)")
    parser.add_argument("--model", choices=MODELS, default="share",
                        help="headline runtime model: share (round-robin sharing stretches "
                             "compute and memory time) or paper (Eq. 4 with the calibrated "
                             "linear f(n)); both are reported")
    parser.add_argument("--max-condition-s", type=float, default=90.0,
                        help="stop measuring a condition after this many seconds")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="JSON from `tta calibrate` (default: calibrate now, saved in --out)")
    parser.add_argument("--quick-calibration", action="store_true",
                        help="when calibrating now: the few-second `tta calibrate --quick`")
    parser.add_argument("--profile", type=Path, default=None,
                        help="reuse this offline profile (profile.json of an earlier run, "
                             "or `tta profile` at the same batch, size and --threads) instead "
                             "of measuring one; ResNet-50 profiling takes 10-25 min on 1 thread")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default runs/predictor-bench-<time>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _calibration(args: argparse.Namespace, out: Path,
                 bar: tqdm) -> tuple[Calibration, str]:
    """The --calibration file's constants, else a calibration run now (saved in `out`);
    with where they come from."""
    from tta_core.adashadow.calibration import (
        CalibrationConfig,
        calibrate,
        load_calibration,
        n_steps,
    )

    if args.calibration is not None:
        return load_calibration(args.calibration), str(args.calibration)
    base = CalibrationConfig.quick() if args.quick_calibration else CalibrationConfig()
    cfg = replace(base, threads=args.threads)
    bar.total += n_steps(cfg)
    bar.refresh()

    def step(msg: str) -> None:
        bar.set_postfix_str(f"calibrate {msg}")
        bar.update(1)

    report = calibrate(cfg, progress=step)
    path = out / "calibration.json"
    report.save(path)
    return report.calibration, str(path)


def run(args: argparse.Namespace) -> int:
    """Measure the predictors' error per condition; print and write the tables."""
    from tqdm import tqdm

    from tta_core.adashadow.predictor import UnitProfile
    from tta_core.eval.predictor_bench import BenchConfig, run_bench, write_outputs

    cfg = BenchConfig(arch=args.arch, image_size=args.image_size, batch_size=args.batch_size,
                      batches=args.batches, threads=args.threads, conditions=args.conditions,
                      sigma=args.sigma, max_condition_s=args.max_condition_s,
                      pi2_mode=args.pi2, model=args.model, split=args.split)
    profile = None
    if args.profile is not None:
        try:
            profile = UnitProfile.load(args.profile)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"tta predictor-bench: cannot read --profile {args.profile}: "
                             f"{exc}") from exc
    out = args.out or Path("runs") / f"predictor-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    total = 1 + cfg.batches * len(cfg.conditions)
    with tqdm(total=total, desc="predictor-bench", disable=args.no_progress) as bar:
        cal, source = _calibration(args, out, bar)
        bar.set_postfix_str("profile + conditions")
        try:
            res = run_bench(cfg, cal, source, tick=bar.update, profile=profile)
        except ValueError as exc:
            if profile is None:
                raise
            raise SystemExit(f"tta predictor-bench: --profile {args.profile}: {exc}") from exc
    paths = write_outputs(res, out)
    print(paths["markdown"].read_text(), end="")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0

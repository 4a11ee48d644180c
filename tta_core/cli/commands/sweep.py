"""`tta sweep SPEC.yaml`: a grid of `tta bench` runs as Ray tasks, cached per cell
(a rerun resumes), aggregated into mean ± 95 % CI over seeds and paired tests."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

NAME = "sweep"
HELP = "run a grid of bench cells on Ray (local or a cluster), resumable, with CIs"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spec", type=Path, help="sweep spec (YAML: name, base, grid, "
                        "exclude, baseline; see config/sweeps/)")
    parser.add_argument("--out", type=Path, default=None,
                        help="sweep folder: cell cache and report (default runs/sweep-<name>)")
    parser.add_argument("--address", default="",
                        help="Ray cluster to join: auto or ray://HOST:PORT (default: start "
                        "a local Ray on this machine)")
    parser.add_argument("--workers", type=int, default=0,
                        help="cells at once on a local Ray (default: cores / cpus-per-cell)")
    parser.add_argument("--cpus-per-cell", type=float, default=1.0,
                        help="Ray CPUs per cell (match the cells' --threads)")
    parser.add_argument("--gpus-per-cell", type=float, default=0.0,
                        help="Ray GPUs per cell (cells with --device cuda)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="run the cells that failed before again")
    parser.add_argument("--list", action="store_true",
                        help="print the cells (cached or not) and run nothing")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _check(args: argparse.Namespace) -> None:
    if args.cpus_per_cell <= 0 or args.gpus_per_cell < 0 or args.workers < 0:
        raise ValueError(f"--cpus-per-cell {args.cpus_per_cell} must be > 0, --gpus-per-cell "
                         f"{args.gpus_per_cell} and --workers {args.workers} >= 0")
    if args.address and not (args.address == "auto" or args.address.startswith("ray://")
                             or ":" in args.address):
        raise ValueError(f"--address {args.address!r}: expected auto, ray://HOST:PORT or "
                         "HOST:PORT")


def run(args: argparse.Namespace) -> int:
    from tta_core.cli.commands import bench
    from tta_core.sweep.driver import sweep
    from tta_core.sweep.run import BenchCLI

    _check(args)
    workers = args.workers or max(1, int((os.cpu_count() or 1) // args.cpus_per_cell))
    res = sweep(args.spec, BenchCLI(bench.add_arguments, bench.config_from_args), args.out,
                address=args.address, workers=workers, cpus_per_cell=args.cpus_per_cell,
                gpus_per_cell=args.gpus_per_cell, retry_failed=args.retry_failed,
                list_only=args.list, progress=not args.no_progress)
    for line in res.lines:
        print(line)
    if res.failed:
        print(f"tta sweep: {res.failed} cell(s) failed (see {res.markdown})", file=sys.stderr)
    return 0

"""`tta calibrate`: measure the predictor's device constants (f(n), b_ratio, offline
frequency and cache hit rate) and the runtime expansion model's offline reference (competing
processes, bandwidth-probe GB/s, torch threads); store them as JSON next to the offline
profiles (the resource monitor's `calibration` parameter). The timed computation is a
matmul, or with `--model-card` your model's no-grad forward on a batch (random at its input
size, or with `--data` your clean images): f(n) is then the slowdown of the model
adaptation serves."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

NAME = "calibrate"
HELP = "measure f(n) (competing processes), b_DRAM/b_cache and offline freq for the predictor"


def default_out() -> Path:
    """config/profiles/calibration_<host>.json."""
    return Path("config/profiles") / f"calibration_{socket.gethostname()}.json"


def _ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(v) for v in text.split(","))
    except ValueError:
        msg = f"--ks must be comma-separated ints, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if 0 not in ks or any(k < 0 for k in ks) or len(set(ks)) < 2:
        raise argparse.ArgumentTypeError(f"--ks must contain 0 and another k >= 0, got {text!r}")
    return ks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help="output JSON (default config/profiles/calibration_<host>.json)")
    parser.add_argument("--quick", action="store_true",
                        help="a few seconds: k in {0,2}, short runs (for tests)")
    parser.add_argument("--ks", type=_ks, default=None,
                        help="competing process counts, e.g. 0,1,2,3 (default)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of the timed workload (0 = torch default, the "
                             "default; --quick uses 1); use the count adaptation will run with")
    parser.add_argument("--model-card", type=Path, default=None,
                        help="time your model's forward (its card: `tta model-card`) "
                             "instead of a matmul")
    parser.add_argument("--data", default=None, metavar="KIND:DIR",
                        help="with --model-card: on a batch of your clean images (folder:DIR, "
                             "cifar10c:DIR, bag:DIR or signs) instead of a random one")
    parser.add_argument("--batch-size", type=int, default=4,
                        help="with --model-card: frames per timed forward (default 4)")
    parser.add_argument("--fit-intercept", action="store_true",
                        help="fit f(n) with a free intercept instead of f(0) = 0")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def model_workload(card_path: Path | None, data: str | None, batch: int
                   ) -> tuple[Callable[[], object] | None, str]:
    """The timed forward of the card's model on `batch` frames of `data` (random without
    it) and its name for the report; (None, "") without a card (the matmul)."""
    if card_path is None:
        if data is not None:
            raise ValueError(f"--data {data} needs --model-card (the model to time)")
        return None, ""
    if batch < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch}")
    import torch

    from tta_core.adashadow.calibration import forward_fn
    from tta_core.model.source import find_card, load_source

    path = find_card(card_path)
    model, card = load_source(path)
    if data is None:
        x = torch.randn(batch, 3, *card.input_hw, generator=torch.Generator().manual_seed(0))
    else:
        from tta_core.cli.offline_inputs import timed_batch

        x = timed_batch(data, card, batch)
    what = f"{data} images" if data is not None else "random images"
    return forward_fn(model, x), f"forward of {path.name} at batch {batch} on {what}"


def run(args: argparse.Namespace) -> int:
    """Calibrate, save the JSON and print the fitted constants."""
    from tqdm import tqdm

    from tta_core.adashadow.calibration import CalibrationConfig, calibrate, n_steps

    base = CalibrationConfig.quick() if args.quick else CalibrationConfig()
    threads = base.threads if args.threads is None else args.threads
    if threads < 0:
        raise ValueError(f"--threads must be >= 0, got {threads}")
    cfg = replace(base, ks=args.ks or base.ks, threads=threads,
                  fit_intercept=args.fit_intercept)
    workload, name = model_workload(args.model_card, args.data, args.batch_size)
    out = args.out or default_out()
    with tqdm(total=n_steps(cfg), desc="calibrate", disable=args.no_progress) as bar:
        def step(msg: str) -> None:
            bar.set_postfix_str(msg)
            bar.update(1)

        report = calibrate(cfg, progress=step, workload=workload, workload_name=name)
    report.save(out)
    cal = report.calibration
    slow = ", ".join(f"k={k}: {s:.2f}x" for k, s in zip(report.ks, report.slowdown, strict=True))
    print(f"f(n) = {cal.f_slope:.3f} n + {cal.f_intercept:.3f}  ({slow}); "
          f"b_ratio = {cal.b_ratio:.2f}; freq_off = {cal.freq_offline_mhz} MHz; "
          f"hit_off = {cal.cache_hit_offline}; n_off = {cal.n_off:g}; probe_bw_off = "
          f"{cal.probe_bw_offline_gbs:.1f} GB/s; threads = {cal.threads}")
    print(f"wrote {out}")
    return 0

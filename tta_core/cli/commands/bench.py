"""`tta bench`: every TTA method on the same shift stream -> accuracy, latency, memory."""

from __future__ import annotations

import argparse
import ast
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tta_core.cli.model_args import add_model_arguments, user_model
from tta_core.data.layouts import LAYOUTS

if TYPE_CHECKING:
    from tta_core.eval.bench_config import BenchConfig

NAME = "bench"
HELP = "benchmark TTA methods on a corruption stream: accuracy per domain, latency, memory"

# Copies of tta_core.eval.bench_config's DEFAULT_METHODS, DEFAULT_CARD, MODES and BenchConfig
# defaults: the bench modules import torch, and `tta bench --help` must not.
# test/system/test_cli_fast.py checks that they are equal.
# (): every registered method that can run on the model (eval.bench_run.runnable_methods)
DEFAULT_METHODS: tuple[str, ...] = ()
DEFAULT_CARD = Path("checkpoints/small_resnet_signs32.json")
MODES: tuple[str, ...] = ("sequential", "parallel")
DEFAULTS: dict[str, object] = {"order": "continual", "severity": 5, "batch_size": 4,
                               "samples_per_domain": 500, "mode": "sequential", "seed": 0,
                               "threads": 1, "device": "cpu", "stream_track": 1,
                               "precision": "fp32"}
# runtime.precision.PRECISIONS (also copied: that module imports torch)
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "bf16")

def _methods(text: str) -> tuple[str, ...]:
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"--methods needs at least one name, got {text!r}")
    return names


def _option(text: str) -> tuple[str, str, object]:
    """METHOD.KEY=VALUE -> (method, key, value); VALUE is a Python literal, a float
    (nan, inf too) or else a string (the config check then names a wrong kind)."""
    head, sep, raw = text.partition("=")
    method, dot, key = head.partition(".")
    if not (sep and dot and method.strip() and key.strip()):
        raise argparse.ArgumentTypeError(f"--set expects METHOD.KEY=VALUE, got {text!r}")
    return method.strip(), key.strip(), _value(raw.strip())


WORDS = {"true": True, "false": False, "none": None, "null": None}  # YAML/ROS spellings


def _value(raw: str) -> object:
    """true/false/none (any case, as in YAML and ROS parameters), a Python literal, else a
    float (`nan`, `inf`, `-inf`), else the string itself."""
    if raw.lower() in WORDS:
        return WORDS[raw.lower()]
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        pass
    try:
        return float(raw)
    except ValueError:
        return raw


def _rates(text: str) -> tuple[float, ...]:
    """'10,20,30' -> (10.0, 20.0, 30.0); each a number > 0."""
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stream-hz expects numbers like 10,30, got "
                                         f"{text!r}") from None
    bad = [r for r in rates if not (r > 0 and r != float("inf"))]
    if not rates or bad:
        raise argparse.ArgumentTypeError(f"--stream-hz needs frame rates > 0 Hz, got {text!r}")
    return rates


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """--task, --data and --corruptions: which images the stream is made of."""
    parser.add_argument("--task", choices=("classification", "segmentation"),
                        default="classification",
                        help="segmentation: a segmentation --model-card on --data acdc:DIR "
                             "(or cityscapes:DIR), scored online by mIoU per condition "
                             "(tta_core.eval.seg_bench: SEG_METHODS)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="--task segmentation: the condition sequence repeated this many "
                             "times, the model never reset (CoTTA's ACDC protocol: 10)")
    parser.add_argument("--data", default="", metavar="KIND:DIR",
                        help="your data instead of the synthetic signs stream: "
                             + "; ".join(f"{k}:DIR = {v}" for k, v in LAYOUTS.items())
                             + ". Corruption data: the standard corruptions found, in the "
                             "standard order, at --severity; --samples-per-domain per domain; "
                             "images resized to the model's input size")
    parser.add_argument("--corruptions", default="", metavar="NAMES|held-out|standard|all",
                        help="the corruptions streamed, in this order (default: the 15 "
                             "standard ones; held-out: speckle_noise, gaussian_blur, spatter, "
                             "saturate, the 4 that DARDA's offline phase never sees)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench options; defaults are BenchConfig's (copied in DEFAULTS)."""
    d = argparse.Namespace(**DEFAULTS)
    parser.add_argument("--methods", type=_methods, default=DEFAULT_METHODS,
                        help="comma-separated (default: every registered method that can run "
                             "on the model; one line names each left out and why)")
    parser.add_argument("--order", default=d.order,
                        help="continual, gradual, mixed, dirichlet, recurring or iid (also for "
                             "--data: recurring repeats the same images, gradual needs "
                             "severities: cifar10c or imagenet-c; iid shuffles each domain "
                             "by --seed, where continual keeps the data's order)")
    parser.add_argument("--severity", type=int, default=d.severity, choices=range(1, 6))
    parser.add_argument("--batch-size", type=int, default=d.batch_size)
    parser.add_argument("--samples-per-domain", type=int, default=d.samples_per_domain)
    parser.add_argument("--model-card", type=Path, default=None,
                        help=f"the source model's card (default {DEFAULT_CARD}; `tta "
                             "model-card` makes one for your model); or use --model below")
    _add_data_arguments(parser)
    parser.add_argument("--mode", choices=MODES, default=d.mode,
                        help="sequential: predict after the update; parallel: predict first")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--threads", type=int, default=d.threads,
                        help="torch threads (0: torch default); fixed for comparable timings")
    parser.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N")
    parser.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                        help="forward precision of every method that takes it (autocast; "
                             "fp16 needs --device cuda; BN statistics, losses and optimizer "
                             "state stay fp32; the others run fp32, said once)")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default runs/bench-<time>)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("--set", type=_option, action="append", default=[], dest="options",
                        metavar="METHOD.KEY=VALUE",
                        help="a method option, e.g. adashadow.sigma=0.5 (repeatable). "
                             "METHOD.lr is the SGD rate at batch METHOD.lr_ref_batch (64): "
                             "steps run with lr × batch / 64 (report.md lists the effective "
                             "rate per method); METHOD.lr_ref_batch=0 turns scaling off")
    parser.add_argument("--telemetry", default="", metavar="live|CALIBRATION.json",
                        help="plan with live pi1/pi2 sampled from this machine (AdaShadow), "
                             "referenced to a `tta calibrate` file or the default ('live')")
    parser.add_argument("--stream-hz", type=_rates, default=(), metavar="HZ[,HZ...]",
                        help="also run every method in streaming mode at these frame rates "
                             "(streaming.md/.json/.png: strict and streaming accuracy)")
    parser.add_argument("--measure-activations", action="store_true",
                        help="count the activations each step saves for backward (saved-"
                             "tensor hooks; costs time): report.md column 'saved MiB "
                             "(mean/max)'. A method twice: --methods surgeon,surgeon@robot "
                             "--set surgeon@robot.mode=robot")
    parser.add_argument("--memory-budget-mb", type=float, default=None, metavar="MIB",
                        help="saved-activation budget in MiB for the methods that take one "
                             "(adashadow: planned with latency at once; see adashadow.graph); "
                             "measures activations: report.md column 'in mem budget %%'")
    parser.add_argument("--stream-track", type=int, default=d.stream_track, metavar="K",
                        help="streaming mode: each sign is seen over K consecutive frames "
                             f"(a vehicle approaching it; default {d.stream_track}; 1: i.i.d.)")
    parser.add_argument("--stream-latency-ms", type=float, default=None, metavar="MS",
                        help="streaming mode: a frame's deadline is its arrival + MS "
                             "(default (2 x batch size - 1) / rate: the batch deadline plus "
                             "the wait for the batch to fill)")
    add_model_arguments(parser, "your model (instead of --model-card)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The BenchConfig of the parsed options (also what `tta sweep` runs per cell)."""
    from tta_core.data.sources import parse_corruptions
    from tta_core.eval.bench_config import BenchConfig
    from tta_core.model.source import find_card

    options: dict[str, dict] = {}
    for method, key, value in args.options:
        if args.methods and method not in args.methods:
            raise ValueError(f"--set {method}.{key}: {method!r} is not among --methods "
                             f"{','.join(args.methods)}")
        options.setdefault(method, {})[key] = value
    um = user_model(args)
    if um is not None and args.model_card is not None:
        raise ValueError(f"--model-card {args.model_card} and --model {args.model} both "
                         "given: give one")
    cfg = BenchConfig(methods=args.methods, order=args.order, severity=args.severity,
                      batch_size=args.batch_size, samples_per_domain=args.samples_per_domain,
                      model_card=(find_card(args.model_card or DEFAULT_CARD) if um is None
                                  else DEFAULT_CARD), mode=args.mode,
                      seed=args.seed, threads=args.threads, device=args.device,
                      method_options=options, telemetry=args.telemetry,
                      stream_hz=args.stream_hz, stream_track=args.stream_track,
                      stream_latency_ms=args.stream_latency_ms, data=args.data,
                      corruptions=parse_corruptions(args.corruptions), user_model=um,
                      measure_activations=args.measure_activations,
                      memory_budget_mb=args.memory_budget_mb, precision=args.precision)
    return cfg


def _segmentation(args: argparse.Namespace) -> int:
    """--task segmentation: the mIoU bench (tta_core.eval.seg_bench)."""
    from tta_core.eval.seg_bench import config_from_args as seg_config
    from tta_core.eval.seg_bench import run_seg_bench

    cfg = seg_config(args)
    out = args.out or Path("runs") / time.strftime("seg-bench-%Y%m%d-%H%M%S")
    _, text = run_seg_bench(cfg, out, progress=not args.no_progress)
    print(text)
    print(f"wrote {out / 'seg_bench.json'}, {out / 'seg_bench.md'}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run the bench of the parsed options; print the report and the files written."""
    from tta_core.eval.bench_run import run_bench

    if args.task == "segmentation":
        return _segmentation(args)

    cfg = config_from_args(args)
    out = args.out or Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    result = run_bench(cfg, out, progress=not args.no_progress,
                       log=lambda line: print(f"tta bench: {line}", file=sys.stderr))
    print(result.markdown)
    if result.files is not None:
        print(f"wrote {result.files.json}, {result.files.markdown}, "
              + ", ".join(str(p) for p in [*result.files.plots, *result.stream_files]))
    return 0

"""`tta demo`: the README's main command. Replays the sample bag (bags/) through the three
ROS 2 nodes (perception, resource_monitor, scheduler) in-process, once per method, and
prints the report table (markdown), the layers updated, the accuracy gained over source
and the files written.

The demo runs the shipped config with camera deadlines (DEMO_SETTINGS): a batch of b
frames must be done before the next b frames of the 30 Hz camera have arrived. The
config's default, the paper's sigma*T (a share of the full update), leaves no unit room
on a small CPU model whose forward is most of T, so AdaShadow would never update."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tta_ros.commands.replay import setup_error
from tta_ros.paths import package_file

if TYPE_CHECKING:
    from tta_ros.replay import ReplayOptions

NAME = "demo"
HELP = "replay the sample bag through the ROS 2 nodes and print the accuracy/latency report"
SAMPLE_BAG = "bags/signs32_sample"  # in the checkout, or the installed share folder
CONFIG = "config/vehicle.yaml"
#: what the demo sets over --config (perception's and scheduler's deadline, kept in step)
DEMO_SETTINGS: dict[str, dict[str, Any]] = {
    "perception": {"method.deadline_mode": "camera", "method.camera_hz": 30.0},
    "scheduler": {"deadline_mode": "camera", "camera_hz": 30.0},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bag", type=Path, default=package_file(SAMPLE_BAG),
                        help="bag to replay (default: the shipped sample bag)")
    parser.add_argument("--config", type=Path, default=package_file(CONFIG),
                        help="node parameters (default: the shipped config/vehicle.yaml)")
    parser.add_argument("--methods", default="source,adashadow",
                        help="comma-separated perception methods, one replay each")
    parser.add_argument("--rate", default="max", help="real, max or a rate in Hz")
    parser.add_argument("--max-frames", type=int, default=0, help="only the first N images")
    parser.add_argument("--out", type=Path, default=None,
                        help="report folder (default: runs/demo-<time>)")
    parser.add_argument("--config-deadline", action="store_true",
                        help="keep --config's deadline settings instead of the demo's camera "
                        "deadline (30 Hz: a batch of b frames within b / 30 s)")


def check_setup(args: argparse.Namespace) -> str | None:
    """The first missing piece of the set-up, as a message saying how to fix it."""
    err = setup_error()
    if err:
        return err
    if not args.bag.exists():
        return (f"sample bag {args.bag} is missing: run `python bags/make_sample_bag.py` "
                "(or `tta make-bag`)")
    if not args.config.exists():
        return f"node parameters {args.config} are missing (pass --config)"
    from tta_ros.bringup import load_params
    from tta_ros.ros_params import resolve_paths

    card = resolve_paths(load_params(args.config)["perception"]).get("model_card", "")
    if not card or not Path(card).exists():
        return (f"source model card {card or '(none)'} is missing: train it with "
                "`tta train-source` or run `make setup`")
    return None


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    err = check_setup(args)
    if err:
        print(f"tta demo: {err}", file=sys.stderr)
        return 2
    import rclpy

    from tta_core.eval.report_files import write_report
    from tta_ros.replay import replay

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        print(f"tta demo: --methods {args.methods!r} names no method", file=sys.stderr)
        return 2
    out = args.out or Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    runs = []
    for method in methods:
        print(f"replaying {args.bag.name} with {method} ...", file=sys.stderr, flush=True)
        ctx = rclpy.context.Context()
        rclpy.init(context=ctx)
        try:
            res = replay(replay_options(args, method), context=ctx)
        except (ValueError, RuntimeError) as exc:
            print(f"tta demo: {method}: {exc}", file=sys.stderr)
            return 1
        finally:
            ctx.try_shutdown()
        runs.append(res.run)
    files = write_report(runs, out, title=f"tta demo: {args.bag.name}")
    print(files.markdown.read_text())
    for line in verdict(runs):
        print(line)
    for p in (files.json, files.markdown, *files.plots):
        print(f"wrote {p}")
    print(f"demo finished in {time.perf_counter() - t0:.1f} s")
    return 0


def replay_options(args: argparse.Namespace, method: str) -> ReplayOptions:
    """The ReplayOptions of the demo's replay with `method`: the config, with the demo's
    camera deadline unless --config-deadline, each method given only the options it has
    (the config is written for adashadow; the others would name the rest as not used)."""
    from tta_ros.replay import ReplayOptions

    return ReplayOptions(args.bag, args.config, args.rate, method, max_frames=args.max_frames,
                         overrides={} if args.config_deadline else DEMO_SETTINGS,
                         own_options_only=True)


def verdict(runs: list[Any]) -> list[str]:
    """One line per adapting method: how often it adapted and held its budget, and its
    mean accuracy against source's (when source ran)."""
    from tta_core.eval.report import summarize

    sums = {r.method: summarize(r) for r in runs if r.frames}
    src = sums.get("source")
    out = []
    for name, s in sums.items():
        if name == "source":
            continue
        line = (f"{name}: adapted on {100 * s.adapted:.0f} % of {s.n_batches} batches, "
                f"{100 * s.within_budget:.0f} % within budget, mean accuracy "
                f"{100 * s.mean_accuracy:.1f} %")
        if src is not None:
            line += (f" vs source {100 * src.mean_accuracy:.1f} % "
                     f"({100 * (s.mean_accuracy - src.mean_accuracy):+.1f} points)")
        out.append(line)
    return out

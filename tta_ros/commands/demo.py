"""`tta demo`: the README's main command. Replays the sample bag (bags/) through the three
ROS 2 nodes (perception, resource_monitor, scheduler) in-process, once per method, and
prints the report table (markdown), the layers updated, the accuracy gained over source
and the files written.

The demo runs the shipped config with camera deadlines (DEMO_SETTINGS): a batch of b
frames must be done before the next b frames of the 30 Hz camera have arrived. The
config's default, the paper's sigma*T (a share of the full update), leaves no unit room
on a small CPU model whose forward is most of T, so AdaShadow would never update.

`--task segmentation` replays a driving-scene bag (clean, then fog, night, rain, snow;
ground-truth masks) through the shipped segmentation card (SEG_CARD) with source and Tent,
and prints the mIoU per domain of the masks the node published (tta_core.eval.seg_replay).
Its bag is not shipped: it is made on first use (`tta make-bag --task segmentation`,
SEG_BAG_FRAMES scenes, a few MB) into bags/ of the checkout, or the user's cache folder
when that is not writable, and reused after."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tta_ros.commands.replay import setup_error
from tta_ros.launch_params import SEGMENTATION_CARD
from tta_ros.paths import package_file

if TYPE_CHECKING:
    from tta_ros.replay import ReplayOptions

NAME = "demo"
HELP = "replay the sample bag through the ROS 2 nodes and print the accuracy/latency report"
SAMPLE_BAG = "bags/signs32_sample"  # in the checkout, or the installed share folder
CONFIG = "config/vehicle.yaml"
TASKS = ("classification", "segmentation")
SEG_CARD = SEGMENTATION_CARD  # what the launch file's task:=segmentation serves too
SEG_BAG = "bags/scenes_sample"  # made on first use (see the module docstring)
SEG_BAG_FRAMES = 40  # 8 per domain
SEG_BAG_SEED = 2024
SEG_METHODS = "source,tent"
#: what a segmentation demo sets over --config: the segmentation card on both nodes that
#: load one, batches of 4 frames
SEG_SETTINGS: dict[str, dict[str, Any]] = {"perception": {"batch_size": 4},
                                           "scheduler": {}}
#: what the demo sets over --config (perception's and scheduler's deadline, kept in step)
DEMO_SETTINGS: dict[str, dict[str, Any]] = {
    "perception": {"method.deadline_mode": "camera", "method.camera_hz": 30.0},
    "scheduler": {"deadline_mode": "camera", "camera_hz": 30.0},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--task", choices=TASKS, default="classification",
                        help="segmentation: the driving-scene bag through the segmentation "
                        "card, scored by mIoU per domain")
    parser.add_argument("--bag", type=Path, default=None,
                        help="bag to replay (default: the shipped sample bag; segmentation: "
                        "the scene bag, made on first use)")
    parser.add_argument("--config", type=Path, default=package_file(CONFIG),
                        help="node parameters (default: the shipped config/vehicle.yaml)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated perception methods, one replay each (default: "
                        f"source,adashadow; segmentation: {SEG_METHODS})")
    parser.add_argument("--rate", default="max", help="real, max or a rate in Hz")
    parser.add_argument("--max-frames", type=int, default=0, help="only the first N images")
    parser.add_argument("--out", type=Path, default=None,
                        help="report folder (default: runs/demo-<time>)")
    parser.add_argument("--config-deadline", action="store_true",
                        help="keep --config's deadline settings instead of the demo's camera "
                        "deadline (30 Hz: a batch of b frames within b / 30 s)")


def seg_bag_path() -> Path:
    """Where the segmentation demo's bag is (or will be made): the checkout's (or the
    share folder's) bags/ when it exists there or can be written, else the user's cache."""
    shipped = package_file(SEG_BAG)
    if shipped.exists() or os.access(shipped.parent, os.W_OK):
        return shipped
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "tta" / Path(SEG_BAG).name


def ensure_seg_bag(path: Path) -> Path:
    """The segmentation demo's bag at `path`, made first when missing (into a temporary
    folder renamed at the end: an interrupted run leaves no half bag)."""
    if path.exists():
        return path
    import shutil

    from tta_core.cli.commands.make_bag import make_bag

    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    print(f"making the scene bag {path} (once) ...", file=sys.stderr, flush=True)
    make_bag(tmp, SEG_BAG_FRAMES, 0, None, SEG_BAG_SEED, task="segmentation")
    tmp.rename(path)
    return path


def fill_defaults(args: argparse.Namespace) -> None:
    """The task's bag and methods where not given."""
    seg = args.task == "segmentation"
    if args.bag is None:  # only the default bag is made on first use
        args.make_bag = seg
        args.bag = seg_bag_path() if seg else package_file(SAMPLE_BAG)
    args.make_bag = getattr(args, "make_bag", False)
    if args.methods is None:
        args.methods = SEG_METHODS if seg else "source,adashadow"


def check_setup(args: argparse.Namespace) -> str | None:
    """The first missing piece of the set-up, as a message saying how to fix it."""
    err = setup_error()
    if err:
        return err
    if not args.bag.exists() and not getattr(args, "make_bag", False):
        return (f"sample bag {args.bag} is missing: run `python bags/make_sample_bag.py` "
                "(or `tta make-bag`)")
    if not args.config.exists():
        return f"node parameters {args.config} are missing (pass --config)"
    if args.task == "segmentation":
        card = package_file(SEG_CARD)
        return None if card.exists() else f"segmentation card {card} is missing"
    from tta_ros.bringup import load_params
    from tta_ros.ros_params import resolve_paths

    card = resolve_paths(load_params(args.config)["perception"]).get("model_card", "")
    if not card or not Path(card).exists():
        return (f"source model card {card or '(none)'} is missing: train it with "
                "`tta train-source` or run `make setup`")
    return None


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    fill_defaults(args)
    err = check_setup(args)
    if err:
        print(f"tta demo: {err}", file=sys.stderr)
        return 2
    import rclpy

    from tta_ros.replay import replay

    if args.make_bag:
        ensure_seg_bag(args.bag)

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
    files = write_files(runs, out, args)
    print(files.markdown.read_text())
    for line in (seg_verdict if args.task == "segmentation" else verdict)(runs):
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

    fill_defaults(args)
    overrides = {k: dict(v) for k, v in ({} if args.config_deadline else DEMO_SETTINGS).items()}
    if args.task == "segmentation":
        from tta_core.eval.seg_bench import SEG_SETTINGS as SEG_OPTIONS

        card = str(package_file(SEG_CARD))
        for node, values in SEG_SETTINGS.items():
            overrides.setdefault(node, {}).update({**values, "model_card": card})
        # the method's options of `tta bench --task segmentation` (CoTTA's ACDC optimizer)
        overrides["perception"].update({f"method.{k}": v
                                        for k, v in SEG_OPTIONS.get(method, {}).items()})
    return ReplayOptions(args.bag, args.config, args.rate, method, max_frames=args.max_frames,
                         overrides=overrides, own_options_only=True)


def write_files(runs: list[Any], out: Path, args: argparse.Namespace) -> Any:
    """The report files: bench-style (classification) or mIoU per domain (segmentation)."""
    title = f"tta demo: {args.bag.name}"
    if args.task == "segmentation":
        from tta_core.eval.seg_replay import write_seg_report

        return write_seg_report(runs, out, title)
    from tta_core.eval.report_files import write_report

    return write_report(runs, out, title=title)


def seg_verdict(runs: list[Any]) -> list[str]:
    """One line per adapting method of a segmentation demo: its mean mIoU against
    source's (when source ran) and how often it adapted."""
    src = next((r for r in runs if r.method == "source"), None)
    out = []
    for r in runs:
        if r.method == "source":
            continue
        line = (f"{r.method}: adapted on {100 * r.adapted_share:.0f} % of its batches, "
                f"mean mIoU {100 * r.mean_miou:.1f} %")
        if src is not None:
            line += (f" vs source {100 * src.mean_miou:.1f} % "
                     f"({100 * (r.mean_miou - src.mean_miou):+.1f} points)")
        out.append(line)
    return out


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

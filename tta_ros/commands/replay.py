"""`tta replay BAG`: play a bag through the perception/scheduler/monitor nodes over ROS 2
and write the bench report plus end-to-end latency (see tta_ros.replay).

A segmentation bag (ground-truth masks) is replayed as the launch file's
`task:=segmentation` does: the shipped segmentation card with tent unless --model-card /
--method say otherwise; its report is the mIoU per domain (seg_report.json / .md)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tta_ros.paths import package_file

if TYPE_CHECKING:
    from tta_ros.replay import ReplayResult

NAME = "replay"
HELP = "replay a bag through the ROS 2 nodes and write the accuracy/latency report"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bag", type=Path, help="rosbag2 directory (or .mcap / .db3 file)")
    parser.add_argument("--config", type=Path, default=package_file("config/vehicle.yaml"),
                        help="node parameters (default: the shipped config/vehicle.yaml)")
    parser.add_argument("--rate", default="max",
                        help="real (bag timing), max (flow-controlled) or a rate in Hz")
    parser.add_argument("--method", default=None, help="override the perception method")
    parser.add_argument("--model-card", default="", help="perception's and the scheduler's "
                        "model card (default: the config's; a segmentation bag: the shipped "
                        "segmentation card)")
    parser.add_argument("--out", type=Path, default=None,
                        help="report folder (default: runs/replay-<time>)")
    parser.add_argument("--external", action="store_true",
                        help="use nodes already running instead of starting them in-process")
    parser.add_argument("--allow-drops", action="store_true",
                        help="at --rate max, publish without waiting for predictions")
    parser.add_argument("--window", type=int, default=0,
                        help="images in flight at --rate max (default: the batch size)")
    parser.add_argument("--max-frames", type=int, default=0, help="replay only the first N")
    parser.add_argument("--image-topic", default="image", help="perception image topic")
    parser.add_argument("--timeout", type=float, default=20.0,
                        help="seconds without a prediction before giving up on the rest")


def setup_error() -> str | None:
    """Why ROS 2 / tta_msgs cannot be used here, or None when they can."""
    try:
        import rclpy  # noqa: F401
    except ImportError as exc:
        return f"rclpy is not importable ({exc}): run `make setup` then `source build/env.sh`"
    try:
        import tta_msgs.msg  # noqa: F401
    except ImportError as exc:
        return f"tta_msgs is not built ({exc}): run `make setup` then `source build/env.sh`"
    return None


def run(args: argparse.Namespace) -> int:
    err = setup_error()
    if err:
        print(f"tta replay: {err}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from tta_ros.replay import ReplayOptions, replay

    out = args.out or Path("runs") / time.strftime("replay-%Y%m%d-%H%M%S")
    try:
        overrides, method = card_overrides(args)
        opts = ReplayOptions(args.bag, args.config, args.rate, method, out,
                             args.external, args.allow_drops, args.window,
                             max_frames=args.max_frames, image_topic=args.image_topic,
                             timeout_s=args.timeout, overrides=overrides,
                             own_options_only=bool(overrides))
    except ValueError as exc:
        print(f"tta replay: {exc}", file=sys.stderr)
        return 2
    bars: list[tqdm] = []  # opened at the first image: a start-up error stays one line

    def progress(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(desc="replay", unit="img", total=total))
        bars[0].update(done - bars[0].n)

    try:  # bad bag/card/config: tta_core.cli reports it in one line
        res = replay(opts, progress=progress)
    except RuntimeError as exc:  # no perception node answered
        print(f"tta replay: {exc}", file=sys.stderr)
        return 1
    finally:
        for bar in bars:
            bar.close()
    return print_result(res)


def card_overrides(args: argparse.Namespace) -> tuple[dict, str | None]:
    """(node overrides, perception method) of --model-card and, for a segmentation bag,
    the launch file's task:=segmentation defaults (tta_ros.launch_params)."""
    from tta_core.io.bag import bag_info
    from tta_ros.launch_params import launch_overrides

    seg = Path(args.bag).exists() and bag_info(args.bag).task == "segmentation"
    if not seg and not args.model_card:
        return {}, args.method
    overrides = launch_overrides(args.method or "", task="segmentation" if seg else "",
                                 model_card=args.model_card)
    return overrides, overrides.get("perception", {}).get("method", args.method)


def print_result(res: ReplayResult) -> int:
    """Print the markdown table and file paths of a replay; exit status."""
    files = res.files
    if files is None:
        print("tta replay: no predictions received, nothing to report", file=sys.stderr)
        return 1
    print(files.markdown.read_text())
    print(f"published {res.n_published}, predictions {res.n_predictions}, "
          f"statuses {res.n_statuses}, dropped {res.run.frames_dropped}"
          + (" (interrupted)" if res.interrupted else ""))
    for p in (files.json, files.markdown, *files.plots):
        print(f"wrote {p}")
    return 0

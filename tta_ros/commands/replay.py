"""`tta replay BAG`: play a bag through the perception/scheduler/monitor nodes over ROS 2
and write the bench report plus end-to-end latency (see tta_ros.replay)."""

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
        opts = ReplayOptions(args.bag, args.config, args.rate, args.method, out,
                             args.external, args.allow_drops, args.window,
                             max_frames=args.max_frames, image_topic=args.image_topic,
                             timeout_s=args.timeout)
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

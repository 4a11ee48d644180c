"""Cost of refusing degenerate frames in the decoder (goal: a 2,000,000 x 1 frame refused in
< 50 ms), next to the decode time of valid frames.

Prints JSON: median ms (over --repeats) to refuse a 2,000,000 x 1 rgb8 frame (6 MB of data,
held as rclpy holds it: array.array('B')) and a 32FC3 frame with values ~1e6; median ms to
decode valid 640 x 480 rgb8 and 32FC3 frames (the float one includes the range check),
measured before and after the refusals; and what the tall frame would have cost admitted
(once: decode + resize to the card's 32 px, FrameLimits widened), next to valid frames at
the default limits (4096 x 4096; 18300 x 915, aspect 20).
Usage: python benchmarks/field/bench_bad_frames.py [--repeats 50] [--skip-admitted]
"""

from __future__ import annotations

import argparse
import array
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np

from tta_core.io.image_msg import (
    FrameLimits,
    Preprocess,
    array_to_image_fields,
    decode_image,
    to_tensor,
)


def _msg(rgb: np.ndarray, encoding: str) -> SimpleNamespace:
    fields = array_to_image_fields(rgb, encoding)
    fields["data"] = array.array("B", fields["data"])  # as rclpy delivers Image.data
    return SimpleNamespace(**fields)


def _median_ms(fn: Callable[[], object], repeats: int, refused: bool = False) -> float:
    """Median ms of `fn` (which must raise ValueError when `refused`, else must not)."""

    def call() -> None:
        try:
            fn()
        except ValueError:
            if not refused:
                raise
        else:
            if refused:
                raise AssertionError("frame was not refused")

    return round(harness.repeat(call, repeats, warmup=0).median, 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--skip-admitted", action="store_true",
                    help="do not time the tall frame admitted (takes seconds)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    tall = _msg(np.full((2_000_000, 1, 3), 0.5, dtype=np.float32), "rgb8")
    hot = _msg((1e6 * (1 + rng.random((480, 640, 3)))).astype(np.float32), "32FC3")
    valid = {enc: _msg(rng.random((480, 640, 3)).astype(np.float32), enc)
             for enc in ("rgb8", "32FC3")}

    def decode_valid() -> dict[str, float]:
        return {enc: _median_ms(lambda m=m: decode_image(m), args.repeats)
                for enc, m in valid.items()}

    out: dict[str, object] = {"repeats": args.repeats, "valid_640x480_decode_ms_before":
                              decode_valid()}
    out["refuse_2000000x1_rgb8_ms"] = _median_ms(lambda: decode_image(tall), args.repeats,
                                                 refused=True)
    out["refuse_640x480_32FC3_1e6_ms"] = _median_ms(lambda: decode_image(hot), args.repeats,
                                                    refused=True)
    out["valid_640x480_decode_ms_after"] = decode_valid()
    out["goal_refuse_ms"] = 50.0
    out["goal_met"] = out["refuse_2000000x1_rgb8_ms"] < 50.0
    if not args.skip_admitted:
        wide = FrameLimits(max_aspect=3e6)
        pre = Preprocess(32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
        out["admitted_2000000x1_decode_and_resize_ms"] = _median_ms(
            lambda: to_tensor([decode_image(tall, wide)], pre), 1)
        for h, w in ((4096, 4096), (18300, 915)):  # at max_pixels; at max_pixels and aspect
            big = _msg(np.zeros((h, w, 3), dtype=np.float32), "rgb8")
            out[f"at_limit_{h}x{w}_decode_and_resize_ms"] = _median_ms(
                lambda m=big: to_tensor([decode_image(m)], pre), 3)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

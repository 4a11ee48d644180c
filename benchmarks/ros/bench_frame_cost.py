"""What one camera frame costs the perception node, from its serialized bytes to the model's
input (goal: at most 20 ms p50 for any raw frame the input limits admit), and how long the
valid frames behind a large one wait (goal: at most 50 ms more than alone).

Per kind of frame (raw: the largest each encoding family may send at the default limits,
and ordinary 640 x 480 and 64 x 64 ones; compressed: JPEG and PNG at 4K, 1080p and VGA),
camera-like content (a sign upscaled, sensor noise of 2/255): p50 and max ms over
--repeats of the node's conversion (tta_ros.convert.frame_tensor: read from the CDR bytes,
reduced for the card's side, normalised), next to the conversion it replaced (rclpy
deserialization, decode_image / decode_compressed of the whole frame, to_tensor) over
--old-repeats; the JPEG decode scale used; a 16UC1 frame (not an admitted encoding)
refused. Then, over real rclpy (tta_ros.nodes.perception, method source, batch size 1;
skipped with --no-node): the latency of valid frames alone and of the valid frame sent
right behind each 4096 x 4096 mono8 and 3840 x 2160 rgb8 frame, and (input compressed)
each 4K JPEG and PNG frame (median, max). Writes
docs/results/frame_cost.{json,md}.
Usage: python benchmarks/ros/bench_frame_cost.py [--repeats 30] [--old-repeats 5] [--rounds 6]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test"))  # helpers.ros
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
from rclpy.serialization import deserialize_message, serialize_message
from sensor_msgs.msg import CompressedImage, Image

from tta_core.data.signs import make_signs
from tta_core.io.image_msg import (
    FrameLimits,
    Preprocess,
    array_to_image_fields,
    decode_compressed,
    decode_image,
    to_tensor,
)
from tta_core.model.source import load_source
from tta_ros.convert import FRAME_INPUTS, frame_tensor
from tta_ros.frame_reduce import jpeg_scale

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "checkpoints" / "small_resnet_signs32.json"
GOAL_MS = 20.0
DELAY_GOAL_MS = 50.0
RAW = (("mono8", 4096, 4096), ("rgb8", 2160, 3840), ("bgr8", 2160, 3840),
       ("32FC3", 4096, 4096), ("mono16", 4096, 4096), ("bayer_rggb8", 4096, 4096),
       ("yuv422", 2160, 3840), ("rgb8", 480, 640), ("rgb8", 64, 64))
COMPRESSED = (("jpeg", 2160, 3840), ("jpeg", 1080, 1920), ("jpeg", 480, 640),
              ("png", 2160, 3840), ("png", 480, 640))


def camera(h: int, w: int) -> np.ndarray:
    """A sign upscaled to h x w with sensor noise: uint8 RGB."""
    sign = make_signs(1, image_size=64, seed=7).images[0]
    big = cv2.resize(sign, (w, h), interpolation=cv2.INTER_LINEAR).astype(np.float32)
    big += np.random.default_rng(h + w).normal(0.0, 2.0, big.shape).astype(np.float32)
    return np.clip(big, 0, 255).astype(np.uint8)


def raw_frame(encoding: str, h: int, w: int) -> bytes:
    """A serialized sensor_msgs/Image of camera content in `encoding` (YUV and Bayer
    built from the RGB frame with OpenCV)."""
    rgb = camera(h, w)
    if encoding.startswith("bayer"):  # rggb: R G / G B
        mosaic = rgb[:, :, 1].copy()
        mosaic[0::2, 0::2], mosaic[1::2, 1::2] = rgb[0::2, 0::2, 0], rgb[1::2, 1::2, 2]
        fields = {"height": h, "width": w, "encoding": encoding, "step": w,
                  "data": mosaic.tobytes()}
    elif encoding == "yuv422":  # UYVY from BT.601 YUV
        yuv = cv2.cvtColor(rgb, cv2.COLOR_RGB2YUV).astype(np.uint16)
        uyvy = np.empty((h, w // 2, 4), np.uint8)
        uyvy[..., 0] = (yuv[:, 0::2, 1] + yuv[:, 1::2, 1]) // 2
        uyvy[..., 1], uyvy[..., 3] = yuv[:, 0::2, 0], yuv[:, 1::2, 0]
        uyvy[..., 2] = (yuv[:, 0::2, 2] + yuv[:, 1::2, 2]) // 2
        fields = {"height": h, "width": w, "encoding": encoding, "step": 2 * w,
                  "data": uyvy.tobytes()}
    else:
        fields = array_to_image_fields(rgb.astype(np.float32) / 255.0, encoding)
    return serialize_message(Image(**fields))


def compressed_frame(codec: str, h: int, w: int) -> bytes:
    bgr = np.ascontiguousarray(camera(h, w)[..., ::-1])
    params = [cv2.IMWRITE_JPEG_QUALITY, 90] if codec == "jpeg" else []
    data = cv2.imencode(".jpg" if codec == "jpeg" else ".png", bgr, params)[1].tobytes()
    return serialize_message(CompressedImage(format=codec, data=data))


def times_ms(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    """p50 and max ms of `fn` over `repeats` calls, after one unmeasured call."""
    s = harness.repeat(fn, repeats).stats()
    return {"p50_ms": round(s["p50"], 3), "max_ms": round(s["max"], 3)}


def old_path(data: bytes, kind: str, limits: FrameLimits, pre: Preprocess
             ) -> Callable[[], object]:
    """The conversion the node ran before: deserialize, decode whole, resize."""
    decode = decode_image if kind == "raw" else decode_compressed

    def run() -> torch.Tensor:
        return to_tensor([decode(deserialize_message(data, FRAME_INPUTS[kind].msg_type),
                                 limits)], pre)
    return run


def measure_kind(kind: str, name: str, data: bytes, args: argparse.Namespace,
                 pre: Preprocess) -> dict:
    limits = FrameLimits()
    row = {"kind": name, "mb": round(len(data) / 1e6, 2),
           "new": times_ms(lambda: frame_tensor(data, kind, limits, pre), args.repeats)}
    row["old"] = times_ms(old_path(data, kind, limits, pre), args.old_repeats)
    row["goal_met"] = kind == "compressed" or row["new"]["p50_ms"] <= GOAL_MS
    print(f"{name:28s} {row['mb']:7.2f} MB  new p50 {row['new']['p50_ms']:7.2f} max "
          f"{row['new']['max_ms']:7.2f} ms  old p50 {row['old']['p50_ms']:8.1f} ms")
    return row


def refused(pre: Preprocess, repeats: int) -> dict:
    """A 4096 x 4096 16UC1 frame (depth images: no admitted encoding): refused."""
    data = serialize_message(Image(height=4096, width=4096, encoding="16UC1", step=8192,
                                   data=bytes(8192 * 4096)))
    try:
        frame_tensor(data, "raw", FrameLimits(), pre)
    except ValueError as exc:
        reason = str(exc)
    else:
        raise AssertionError("16UC1 admitted: add it to the kinds measured")

    def refuse() -> None:
        try:
            frame_tensor(data, "raw", FrameLimits(), pre)
        except ValueError:
            return
    return {"kind": "16UC1 4096x4096", "reason": reason, **times_ms(refuse, repeats)}


def node_delay(kind: str, larges: list, rounds: int) -> dict:
    """Valid frames' latency over rclpy (input `kind`) alone and right behind each of
    `larges` (messages), `rounds` times."""
    import rclpy
    from helpers.ros import CameraRig

    ctx = rclpy.context.Context()
    rclpy.init(context=ctx, domain_id=random.randint(1, 200))
    cam = CameraRig(ctx, kind)
    try:
        for stamp in range(3):
            cam.send_valid(stamp)
        alone = [cam.send_valid(100 + i) for i in range(3 * rounds)]
        behind = []
        for r in range(rounds):
            for k, msg in enumerate(larges):
                stamp = 500 + len(larges) * r + k
                cam.send_large(msg, stamp)
                behind.append(cam.send_valid(200 + len(larges) * r + k))
                cam.wait_answered(stamp, 60.0)
    finally:
        cam.close()
        ctx.try_shutdown()
    out = {"input": kind, "alone_median_ms": round(statistics.median(alone), 2),
           "alone_max_ms": round(max(alone), 2), "alone_n": len(alone),
           "behind_median_ms": round(statistics.median(behind), 2),
           "behind_max_ms": round(max(behind), 2), "behind_n": len(behind)}
    out["goal_met"] = out["behind_median_ms"] <= out["alone_median_ms"] + DELAY_GOAL_MS
    print(f"node ({kind}): valid alone median {out['alone_median_ms']} ms, behind a large "
          f"frame median {out['behind_median_ms']} ms (max {out['behind_max_ms']})")
    return out


def node_rows(rounds: int) -> list[dict]:
    """node_delay behind 4096x4096 mono8 and 3840x2160 rgb8 raw frames, and behind 4K
    JPEG and PNG frames (every large frame answered, or node_delay raises)."""
    from helpers.ros import large_image

    raw = node_delay("raw", [large_image(4096, 4096, "mono8"),
                             large_image(2160, 3840, "rgb8")], rounds)
    raw["behind"] = "a 4096x4096 mono8 or 3840x2160 rgb8 frame"
    cmp = node_delay("compressed", [deserialize_message(compressed_frame(c, 2160, 3840),
                                                        CompressedImage)
                                    for c in ("jpeg", "png")], rounds)
    cmp["behind"] = "a 3840x2160 JPEG or PNG frame"
    return [raw, cmp]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--old-repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=6, help="large frames of each size sent "
                    "between valid ones over rclpy")
    ap.add_argument("--no-node", action="store_true", help="skip the rclpy measurement")
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args(argv)
    pre = Preprocess.from_card(load_source(CARD)[1])
    out: dict = {"model_side": pre.image_size, "torch_threads": torch.get_num_threads(),
                 "repeats": args.repeats, "old_repeats": args.old_repeats,
                 "goal_ms": GOAL_MS, "delay_goal_ms": DELAY_GOAL_MS}
    out["raw"] = [measure_kind("raw", f"{enc} {w}x{h}", raw_frame(enc, h, w), args, pre)
                  for enc, h, w in RAW]
    out["compressed"] = []
    for codec, h, w in COMPRESSED:
        row = measure_kind("compressed", f"{codec} {w}x{h}", compressed_frame(codec, h, w),
                           args, pre)
        row["scale"] = jpeg_scale(h, w, pre.image_size) if codec == "jpeg" else 1
        out["compressed"].append(row)
    out["refused"] = [refused(pre, args.repeats)]
    if not args.no_node:
        out["node"] = node_rows(args.rounds)
    if not args.no_save:
        print(harness.save("frame_cost", out, options=args))
    ok = all(r["goal_met"] for r in [*out["raw"], *out.get("node", [])])
    return 0 if ok else 1


def render(data: dict) -> str:
    """Per kind: size, the node's conversion now and before; the rclpy delay."""
    lines = [f"From serialized bytes to the {data['model_side']} px model input, ms over "
             f"{data['repeats']} conversions (before: {data['old_repeats']}), "
             f"{data['torch_threads']} torch threads; goal for raw frames: p50 at most "
             f"{data['goal_ms']:g} ms.", "",
             "| frame | MB | p50 | max | before: p50 | before: max | goal |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in data["raw"]:
        lines.append(f"| {r['kind']} | {r['mb']:.2f} | {r['new']['p50_ms']:.2f} | "
                     f"{r['new']['max_ms']:.2f} | {r['old']['p50_ms']:.1f} | "
                     f"{r['old']['max_ms']:.1f} | {'met' if r['goal_met'] else 'missed'} |")
    lines += ["", "Compressed (JPEG quality 90; scale: libjpeg's reduced decode, 1 = whole; "
              "PNG has none):", "",
              "| frame | MB | scale | p50 | max | before: p50 | before: max |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["compressed"]:
        lines.append(f"| {r['kind']} | {r['mb']:.2f} | 1/{r['scale']} | "
                     f"{r['new']['p50_ms']:.2f} | {r['new']['max_ms']:.2f} | "
                     f"{r['old']['p50_ms']:.1f} | {r['old']['max_ms']:.1f} |")
    for r in data["refused"]:
        lines += ["", f"{r['kind']}: refused in {r['p50_ms']:.3f} ms p50 ({r['reason']})."]
    if data.get("node"):
        lines += ["", "Over rclpy (perception node, method source, batch size 1, every large "
                  "frame answered): latency of a valid frame from publication to its "
                  f"prediction, ms; goal: the median behind a large frame at most "
                  f"{data['delay_goal_ms']:g} ms above alone.", "",
                  "| input | valid frame | n | median | max | goal |",
                  "|---|---|---:|---:|---:|---|"]
        for n in data["node"]:
            lines += [f"| {n['input']} | alone | {n['alone_n']} | {n['alone_median_ms']:.1f} "
                      f"| {n['alone_max_ms']:.1f} | |",
                      f"| {n['input']} | right behind {n['behind']} | {n['behind_n']} | "
                      f"{n['behind_median_ms']:.1f} | {n['behind_max_ms']:.1f} | "
                      f"{'met' if n['goal_met'] else 'missed'} |"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

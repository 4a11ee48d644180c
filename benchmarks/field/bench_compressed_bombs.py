"""Cost of refusing compressed-image bombs (goal: < 1 ms each), next to what decoding them
costs (what the perception node spent before the decode budget existed).

The bombs are the fuzz cases of issue #33 (test/helpers/bombs.py): a ~0.6 KB JPEG whose
header says 4000 x 4000, a 47 KB PNG of zeros 4000 x 4000 RGB, a 130 KB 16-bit RGBA PNG
of zeros 4096 x 4096; and a 47 KB PNG declaring 64 x 48 whose stream inflates to 48 MB
(within the budget: refused by the stream check). Prints JSON, per bomb: the file size,
the median ms (over --repeats) to refuse it in tta_core.io.image_msg.decode_compressed at
the default limits,
the median ms of the perception node's whole path (tta_ros.convert.decode_frame:
deserialize the CompressedImage, read the header, refuse; when rclpy is importable), and
the median ms of cv2.imdecode on it (over --decode-repeats), for comparison; then a valid
64 px PNG frame's decode time. Writes docs/results/compressed_bombs.{json,md}.
Usage: python benchmarks/field/bench_compressed_bombs.py [--repeats 200] [--decode-repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test"))  # helpers.bombs
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
from helpers.bombs import bombs, zero_stream_bomb

from tta_core.io.image_msg import FrameLimits, FrameTooLarge, decode_compressed


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    return round(harness.repeat(fn, repeats, warmup=0).median, 4)


def _refuse(decode: Callable[[], object]) -> Callable[[], None]:  # FrameTooLarge expected
    def run() -> None:
        try:
            decode()
        except FrameTooLarge:
            return
        raise AssertionError("bomb not refused")
    return run


def _node_path() -> Callable[[bytes], object] | None:
    """The perception node's per-frame path on serialized bytes, None without rclpy."""
    try:
        from rclpy.serialization import serialize_message
        from sensor_msgs.msg import CompressedImage

        from tta_ros.convert import decode_frame
    except ImportError:
        return None
    limits = FrameLimits()

    def run(fmt: str, data: bytes) -> Callable[[], object]:
        raw = serialize_message(CompressedImage(format=fmt, data=data))
        return lambda: decode_frame(raw, "compressed", limits)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--decode-repeats", type=int, default=3)
    args = ap.parse_args()
    node = _node_path()
    out: dict[str, object] = {"max_decode_bytes": FrameLimits().max_decode_bytes}
    for b in [*bombs(), zero_stream_bomb()]:
        msg = SimpleNamespace(format=b.format, data=b.data)
        buf = np.frombuffer(b.data, np.uint8)
        row = {"bytes": len(b.data), "declared": f"{b.width}x{b.height}x{b.channels} "
               f"{b.bits}-bit",
               "refuse_ms": _median_ms(_refuse(lambda m=msg: decode_compressed(m)),
                                       args.repeats)}
        if node is not None:
            row["node_path_refuse_ms"] = _median_ms(_refuse(node(b.format, b.data)),
                                                    args.repeats)
        row["imdecode_ms"] = _median_ms(lambda x=buf: cv2.imdecode(x, cv2.IMREAD_COLOR),
                                        args.decode_repeats)
        out[b.name] = row
    img = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    valid = SimpleNamespace(format="png", data=cv2.imencode(".png", img)[1].tobytes())
    out["valid_png_64px_decode_ms"] = _median_ms(lambda: decode_compressed(valid),
                                                 args.repeats)
    print(json.dumps(out, indent=1))
    harness.save("compressed_bombs", out, options=args)


def render(data: dict) -> str:
    """One row per bomb: size, declared image, refuse ms (decoder, node path), decode ms."""
    lines = [f"Default decode budget {data['max_decode_bytes']:,} bytes; medians, ms.", "",
             "| bomb | bytes | declared | refuse | refuse, node path | cv2.imdecode |",
             "|---|---:|---|---:|---:|---:|"]
    for name, r in data.items():
        if isinstance(r, dict):
            node = r.get("node_path_refuse_ms")
            lines.append(f"| {name} | {r['bytes']:,} | {r['declared']} | {r['refuse_ms']:.4f} "
                         f"| {'–' if node is None else f'{node:.4f}'} | "
                         f"{r['imdecode_ms']:.1f} |")
    lines += ["", f"A valid 64 px PNG decodes in {data['valid_png_64px_decode_ms']:.3f} ms."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""ROS path overhead and resource-monitor CPU cost; prints JSON.

1. End-to-end latency image publish -> ClassPrediction received, through the bringup nodes
   over real rclpy/DDS (batch_size 1), against the in-process method.step on the same
   frames. overhead_ms = median over frames of (e2e latency - the node's own step time).
2. CPU time of the resource_monitor node at 10 Hz over `--monitor-s` seconds, measured in
   a child process (time.process_time), minus the same process spinning an empty node.

    source build/env.sh && python benchmarks/bench_ros_overhead.py [--frames 150]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
CARDS = [ROOT / "checkpoints" / f"small_resnet_signs{s}.json" for s in (64, 32)]

MONITOR_CHILD = """
import sys, time, rclpy
from rclpy.executors import SingleThreadedExecutor
from tta_ros.resource_monitor_node import ResourceMonitorNode
rclpy.init()
node = ResourceMonitorNode(parameter_overrides=[]) if sys.argv[1] == "monitor" \\
    else rclpy.create_node("idle")
ex = SingleThreadedExecutor(); ex.add_node(node)
t_end = time.monotonic() + float(sys.argv[2]); c0 = time.process_time(); w0 = time.monotonic()
while time.monotonic() < t_end:
    ex.spin_once(timeout_sec=0.05)
print((time.process_time() - c0) / (time.monotonic() - w0))
"""


def _frames(n: int, size: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.random((size, size, 3)).astype(np.float32) for _ in range(n)]


def in_process_ms(card: Path, frames: list[np.ndarray]) -> list[float]:
    """method.step per frame (conversion included), same method/config as the node."""
    from types import SimpleNamespace

    from tta_core.train_source import load_source

    from tta_core.methods import build_method
    from tta_ros.image_conversion import Preprocess, array_to_image_fields, image_to_tensor

    model, c = load_source(str(card))
    pre = Preprocess.from_card(c)
    s = pre.image_size
    m = build_method("adashadow", model, input_shape=(3, s, s), arch=c["arch"]
                     if isinstance(c, dict) else c.arch)
    out = []
    for f in frames:
        msg = SimpleNamespace(**array_to_image_fields(f, "rgb8"))
        t0 = time.perf_counter()
        m.step(image_to_tensor(msg, pre))
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def ros_path_ms(card: Path, frames: list[np.ndarray], gap_s: float,
                executor: str = "multi") -> dict:
    import rclpy
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
    from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
    from sensor_msgs.msg import Image
    from tta_msgs.msg import AdaptationStatus, ClassPrediction

    from tta_ros.bringup import build_nodes
    from tta_ros.image_conversion import array_to_image_fields

    ctx = rclpy.context.Context()
    rclpy.init(context=ctx, domain_id=77)
    per = {"model_card": str(card), "batch_size": 1, "batch_timeout_s": 0.0, "num_threads": 1,
           "reset_patience": 100000}
    nodes = build_nodes(ROOT / "config" / "vehicle.yaml", {"perception": per, "scheduler": {
        "model_card": str(card)}}, context=ctx)
    probe = rclpy.create_node("probe", context=ctx)
    recv: dict[int, float] = {}
    step: dict[int, float] = {}
    probe.create_subscription(ClassPrediction, "predictions", lambda m: recv.setdefault(
        m.header.stamp.nanosec, time.perf_counter()), 100)
    rel = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
    probe.create_subscription(AdaptationStatus, "adaptation_status", lambda m: step.setdefault(
        m.header.stamp.nanosec, m.total_ms), rel)
    pub = probe.create_publisher(Image, "image", qos_profile_sensor_data)
    ex = (MultiThreadedExecutor(num_threads=4, context=ctx) if executor == "multi"
          else SingleThreadedExecutor(context=ctx))
    for n in [*nodes, probe]:
        ex.add_node(n)
    th = threading.Thread(target=ex.spin, daemon=True)
    th.start()
    time.sleep(1.0)
    sent: dict[int, float] = {}
    msgs = []
    for i, f in enumerate(frames):
        m = Image(**array_to_image_fields(f, "rgb8"))
        m.header.stamp.nanosec = i + 1
        msgs.append(m)
    for m in msgs:
        sent[m.header.stamp.nanosec] = time.perf_counter()
        pub.publish(m)
        time.sleep(gap_s)
    time.sleep(1.0)
    ex.shutdown(timeout_sec=2.0)
    for n in [*nodes, probe]:
        n.destroy_node()
    ctx.try_shutdown()
    keys = sorted(k for k in sent if k in recv and k in step)
    e2e = [(recv[k] - sent[k]) * 1e3 for k in keys]
    over = [(recv[k] - sent[k]) * 1e3 - step[k] for k in keys]
    return {"frames_sent": len(sent), "frames_served": len(keys),
            "e2e_ms_median": statistics.median(e2e), "node_step_ms_median":
            statistics.median(step[k] for k in keys), "overhead_ms_median":
            statistics.median(over), "overhead_ms_p90": float(np.percentile(over, 90))}


def monitor_cpu(seconds: float) -> dict:
    def run(kind: str) -> float:
        out = subprocess.run([sys.executable, "-c", MONITOR_CHILD, kind, str(seconds)],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        return float(out.stdout.strip().splitlines()[-1])
    mon, idle = run("monitor"), run("idle")
    return {"monitor_cpu_percent_of_core": 100 * mon, "idle_spin_cpu_percent_of_core":
            100 * idle, "monitor_minus_idle_percent": 100 * (mon - idle),
            "rate_hz": 10.0, "seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=150)
    ap.add_argument("--gap-s", type=float, default=0.05)
    ap.add_argument("--monitor-s", type=float, default=20.0)
    ap.add_argument("--executor", choices=("multi", "single"), default="multi",
                    help="executor spinning the nodes (bringup uses multi)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    card = next((c for c in CARDS if c.exists()), None)
    if card is None:
        print(json.dumps({"error": f"no checkpoint among {[str(c) for c in CARDS]}"}))
        return 1
    size = json.loads(card.read_text())["image_size"]
    frames = _frames(args.frames, size)
    inproc = in_process_ms(card, frames)
    ros = ros_path_ms(card, frames, args.gap_s, args.executor)
    res = {"card": card.name, "image_size": size, "torch_threads": 1, "executor": args.executor,
           "in_process_step_ms_median": statistics.median(inproc[5:]), **ros,
           "overhead_vs_in_process_ms": ros["e2e_ms_median"] - statistics.median(inproc[5:]),
           **monitor_cpu(args.monitor_s)}
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

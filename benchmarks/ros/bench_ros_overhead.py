"""ROS path overhead per frame and resource-monitor CPU cost; prints JSON.

1. The bringup nodes (perception, scheduler, resource_monitor) over real rclpy/DDS with
   batch_size 1 and batch_timeout_s 0, fed one frame at a time by a probe node. For each
   frame, interleaved so both see the same machine load:
   - ROS path: publish the sensor_msgs/Image -> ClassPrediction received (end to end);
   - in process: decode + tta_core.io.image_msg.to_tensor + method.step of the same frame on
     a second method built exactly like the node's (same card, config, threads).
   overhead_vs_in_process_ms = median(e2e) - median(in-process); overhead_vs_node_step_ms
   = median over frames of (e2e - the node's own step time from adaptation_status).
2. CPU time of the resource_monitor node at 10 Hz over `--monitor-s` seconds, measured in
   a child process (the harness's CPU clock), minus the same process spinning an empty node.

    source build/env.sh && python benchmarks/ros/bench_ros_overhead.py [--frames 150]
        [--executor single|multi]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness
import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = Path(harness.__file__).resolve().parent
WALL = harness.CLOCKS["wall"]  # publish and receive times (an end-to-end latency)
CARD = ROOT / "checkpoints" / "small_resnet_signs32.json"
CONFIG = ROOT / "config" / "vehicle.yaml"

MONITOR_CHILD = """
import sys, rclpy, rclpy.task
sys.path.insert(0, sys.argv[3])  # benchmarks/: the harness
import harness
from rclpy.executors import SingleThreadedExecutor
from tta_ros.lifecycle import activate
from tta_ros.nodes.resource_monitor import ResourceMonitorNode
rclpy.init()
node = activate(ResourceMonitorNode(parameter_overrides=[])) if sys.argv[1] == "monitor" \\
    else rclpy.create_node("idle")
ex = SingleThreadedExecutor(); ex.add_node(node)
# block in the executor as a deployed node does (spin), no polling loop of our own
with harness.Stopwatch(("cpu", "wall")) as sw:
    ex.spin_until_future_complete(rclpy.task.Future(), timeout_sec=float(sys.argv[2]))
print(sw.elapsed["cpu"] / sw.elapsed["wall"])
"""


class Rig:
    """bringup nodes + probe (publisher of images, recorder of predictions/statuses)."""

    def __init__(self, executor: str, domain_id: int) -> None:
        import rclpy
        from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
        from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import Image
        from tta_msgs.msg import AdaptationStatus, ClassPrediction

        from tta_ros.bringup import build_nodes

        self.ctx = rclpy.context.Context()
        rclpy.init(context=self.ctx, domain_id=domain_id)
        per = {"model_card": str(CARD), "batch_size": 1, "batch_timeout_s": 0.0,
               "num_threads": 1, "reset_patience": 100000}
        self.nodes = build_nodes(CONFIG, {"perception": per}, context=self.ctx)
        self.perception = self.nodes[2]
        self.probe = rclpy.create_node("probe", context=self.ctx,
                                       start_parameter_services=False)
        self.cond = threading.Condition()
        self.recv: dict[int, float] = {}
        self.step: dict[int, float] = {}
        self.probe.create_subscription(ClassPrediction, "predictions", self._on_pred, 100)
        rel = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.probe.create_subscription(AdaptationStatus, "adaptation_status", lambda m:
                                       self.step.setdefault(_key(m), m.total_ms), rel)
        self.pub = self.probe.create_publisher(Image, "image", qos_profile_sensor_data)
        self.ex = (MultiThreadedExecutor(num_threads=4, context=self.ctx) if executor == "multi"
                   else SingleThreadedExecutor(context=self.ctx))
        for n in [self.probe, *self.nodes]:  # the consumer first: see the module doc
            self.ex.add_node(n)
        threading.Thread(target=self.ex.spin, daemon=True).start()
        time.sleep(1.0)

    def _on_pred(self, msg) -> None:
        with self.cond:
            self.recv.setdefault(_key(msg), WALL())
            self.cond.notify_all()

    def send(self, msg, timeout_s: float = 2.0) -> float:
        """Publish and wait for the prediction; returns the publish time."""
        t0 = WALL()
        self.pub.publish(msg)
        with self.cond:
            self.cond.wait_for(lambda: _key(msg) in self.recv, timeout_s)
        return t0

    def close(self) -> None:
        self.ex.shutdown(timeout_sec=2.0)
        for n in [*self.nodes, self.probe]:
            n.destroy_node()
        self.ctx.try_shutdown()


def _key(msg) -> int:
    return int(msg.header.stamp.sec) * 10**9 + int(msg.header.stamp.nanosec)


def _messages(n: int, size: int) -> list:
    from sensor_msgs.msg import Image

    from tta_core.io.image_msg import array_to_image_fields

    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        m = Image(**array_to_image_fields(rng.random((size, size, 3)), "rgb8"))
        m.header.stamp.sec = i + 1
        out.append(m)
    return out


def ros_vs_in_process(frames: int, gap_s: float, executor: str, warmup: int = 10) -> dict:
    """Interleaved per-frame timings of the ROS path and the in-process step."""
    from tta_core.io.image_msg import decode_image, to_tensor
    from tta_core.registry import build_method

    rig = Rig(executor, domain_id=77)
    node = rig.perception
    name = node.p["method"]
    method = build_method(name, copy.deepcopy(node.source_model), **node._method_cfg(name))
    msgs = _messages(frames + warmup, node.pre.image_size)
    sent: dict[int, float] = {}
    inproc: list[float] = []
    try:
        for i, m in enumerate(msgs):
            sent[_key(m)] = rig.send(m)
            time.sleep(gap_s / 2)
            ms, _ = harness.timed(lambda m=m: method.step(to_tensor([decode_image(m)],
                                                                     node.pre)))
            if i >= warmup:
                inproc.append(ms)
            time.sleep(gap_s / 2)
        time.sleep(0.5)
    finally:
        rig.close()
    keys = [_key(m) for m in msgs[warmup:] if _key(m) in rig.recv and _key(m) in rig.step]
    e2e = [(rig.recv[k] - sent[k]) * 1e3 for k in keys]
    over = [(rig.recv[k] - sent[k]) * 1e3 - rig.step[k] for k in keys]
    return {"method": name, "plan_source": node.p["plan_source"], "frames_sent": frames,
            "frames_served": len(keys), "e2e_ms_median": statistics.median(e2e),
            "e2e_ms_p90": float(np.percentile(e2e, 90)),
            "node_step_ms_median": statistics.median(rig.step[k] for k in keys),
            "in_process_ms_median": statistics.median(inproc),
            "overhead_vs_in_process_ms": statistics.median(e2e) - statistics.median(inproc),
            "overhead_vs_node_step_ms_median": statistics.median(over),
            "overhead_vs_node_step_ms_p90": float(np.percentile(over, 90))}


def monitor_cpu(seconds: float) -> dict:
    """CPU % of one core of the monitor node at 10 Hz, and of an idle node, in children."""
    def run(kind: str) -> float:
        out = subprocess.run([sys.executable, "-c", MONITOR_CHILD, kind, str(seconds),
                              str(BENCHMARKS)],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        return float(out.stdout.strip().splitlines()[-1])
    mon, idle = run("monitor"), run("idle")
    return {"monitor_cpu_percent_of_core": 100 * mon, "idle_spin_cpu_percent_of_core":
            100 * idle, "monitor_minus_idle_percent": 100 * (mon - idle),
            "monitor_rate_hz": 10.0, "monitor_seconds": seconds}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=150)
    ap.add_argument("--gap-s", type=float, default=0.04, help="idle time between frames")
    ap.add_argument("--monitor-s", type=float, default=20.0, help="0: skip the monitor")
    ap.add_argument("--executor", choices=("single", "multi"), default="single",
                    help="executor spinning the nodes (bringup uses single)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = {"card": CARD.name, "torch_threads": 1, "executor": args.executor,
           **ros_vs_in_process(args.frames, args.gap_s, args.executor)}
    if args.monitor_s > 0:
        res.update(monitor_cpu(args.monitor_s))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

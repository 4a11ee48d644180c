"""SIGINT -> exit time of every node process, idle and with camera frames flowing.

    python benchmarks/ros/bench_shutdown.py [--runs 5] [--nodes perception scheduler ...]

Each run starts one node process as `ros2 run` / `ros2 launch` would (`python -m
tta_ros.nodes.<node>`, the global `-r __node:=<name> -r __ns:=/car1` launch passes, or
`python -m tta_ros.bringup --namespace /car1` for the three nodes in one process) on a ROS
domain of its own, waits until it is ready (its "ready" log line; with frames flowing, also
a prediction received over DDS from the nodes that serve frames), sends SIGINT and times
the exit. "Loaded": a camera publishes 30 frames/s on /car1/image from start to stop; in
bringup the whole pipeline then runs (perception adapting, the scheduler planning each
batch, the monitor sampling); the standalone scheduler and resource monitor do not
subscribe to frames, so for them it is DDS traffic only. Prints per-node times and writes
docs/results/shutdown.{json,md}. `ros2 launch` is not installable here: bringup stands in
for it (the same nodes and the same exit path, in one process).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, results
import harness

ROOT = Path(__file__).resolve().parents[2]

CARD = ROOT / "checkpoints" / "small_resnet_signs32.json"
NAMESPACE = "/car1"
CAMERA_HZ = 30.0
# node -> (command after the interpreter, "ready" lines to wait for, serves frames)
NODES: dict[str, tuple[list[str], int, bool]] = {
    "perception": (["-m", "tta_ros.nodes.perception", "--ros-args", "-r", "__node:=perception",
                    "-r", f"__ns:={NAMESPACE}", "-p", f"model_card:={CARD}",
                    "-p", "num_threads:=1", "-p", "batch_size:=4"], 1, True),
    "resource_monitor": (["-m", "tta_ros.nodes.resource_monitor", "--ros-args",
                          "-r", "__node:=resource_monitor", "-r", f"__ns:={NAMESPACE}",
                          "-p", "enable_perf:=false"], 1, False),
    "scheduler": (["-m", "tta_ros.nodes.scheduler", "--ros-args", "-r", "__node:=scheduler",
                   "-r", f"__ns:={NAMESPACE}", "-p", f"model_card:={CARD}"], 1, False),
    "bringup": (["-m", "tta_ros.bringup", "--namespace", NAMESPACE,
                 "--set", "perception.num_threads=1", "--set", "perception.batch_size=4",
                 "--set", "resource_monitor.enable_perf=false"], 3, True),
}


@dataclass
class Stop:
    """One SIGINT: seconds from the signal to the process's exit, and its exit status."""

    node: str
    loaded: bool
    exit_s: float
    returncode: int


class Camera:
    """Publishes frames on /car1/image at CAMERA_HZ and counts /car1/predictions, on a
    context of its own in `domain` (the node's), from a thread."""

    def __init__(self, domain: int, publish: bool) -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import Image
        from tta_msgs.msg import ClassPrediction

        from tta_ros.spinning import SpinThread

        self.ctx = rclpy.context.Context()
        rclpy.init(context=self.ctx, domain_id=domain)
        self.node = rclpy.create_node("bench_camera", context=self.ctx)
        self.predictions = 0
        self.node.create_subscription(
            ClassPrediction, f"{NAMESPACE}/predictions", self._on_prediction,
            QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))
        self.pub = self.node.create_publisher(Image, f"{NAMESPACE}/image",
                                              qos_profile_sensor_data)
        self.frame = Image(height=32, width=32, encoding="rgb8", step=96,
                           data=bytes(random.Random(0).randrange(256) for _ in range(3072)))
        if publish:
            self.node.create_timer(1.0 / CAMERA_HZ, self._publish)
        self.ex = SingleThreadedExecutor(context=self.ctx)
        self.ex.add_node(self.node)
        self.spin = SpinThread(self.ex)

    def _on_prediction(self, _msg: object) -> None:
        self.predictions += 1

    def _publish(self) -> None:
        self.frame.header.stamp = self.node.get_clock().now().to_msg()
        self.pub.publish(self.frame)

    def close(self) -> None:
        self.spin.stop()  # after the running callback: no callback on a destroyed node
        self.node.destroy_node()
        self.ctx.try_shutdown()


def _wait_ready(proc: subprocess.Popen, lines: int, timeout_s: float) -> list[str]:
    """Read the process's output until `lines` "]: ready" lines (the nodes spin); the
    output so far. RuntimeError when it exits or `timeout_s` passes first."""
    seen: list[str] = []
    ready = 0
    done = threading.Event()
    timer = threading.Timer(timeout_s, lambda: done.is_set() or proc.kill())
    timer.start()
    try:
        assert proc.stdout is not None
        while ready < lines:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"exited {proc.wait()} before ready:\n{''.join(seen[-20:])}")
            seen.append(line)
            ready += "]: ready" in line
    finally:
        done.set()
        timer.cancel()
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # drain
    return seen


def stop_once(node: str, loaded: bool, ready_timeout_s: float = 180.0) -> Stop:
    """Start `node`, wait until it is ready (loaded: and has answered a frame), SIGINT it,
    time the exit."""
    args, lines, serves = NODES[node]
    domain = random.randint(1, 200)
    env = {**os.environ, "ROS_DOMAIN_ID": str(domain), "OMP_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    camera = Camera(domain, publish=loaded)
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, lines, ready_timeout_s)
        if loaded and serves:
            end = time.monotonic() + ready_timeout_s
            while camera.predictions == 0:
                if proc.poll() is not None or time.monotonic() > end:
                    raise RuntimeError(f"{node}: no prediction with frames flowing")
                time.sleep(0.01)
        with harness.Stopwatch() as sw:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=60)
        return Stop(node, loaded, sw.s, code)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        camera.close()


def measure(nodes: list[str], runs: int) -> list[Stop]:
    """`runs` stops of each node, idle then loaded, printed as they come."""
    out = []
    for node in nodes:
        for loaded in (False, True):
            for _ in range(runs):
                stop = stop_once(node, loaded)
                print(f"{node:16s} {'loaded' if loaded else 'idle':6s} "
                      f"exit {stop.exit_s * 1000:7.1f} ms  status {stop.returncode}",
                      flush=True)
                out.append(stop)
    return out


def summary(stops: list[Stop]) -> list[dict]:
    """Per node and load: runs, median / max exit time (ms), how many under 1 s, statuses."""
    rows = []
    for node in dict.fromkeys(s.node for s in stops):
        for loaded in (False, True):
            got = [s for s in stops if s.node == node and s.loaded == loaded]
            if not got:
                continue
            ms = [s.exit_s * 1000.0 for s in got]
            rows.append({"node": node, "load": "frames" if loaded else "idle",
                         "runs": len(got), "median_ms": statistics.median(ms),
                         "max_ms": max(ms), "under_1s": sum(m < 1000.0 for m in ms),
                         "exit_status": sorted({s.returncode for s in got})})
    return rows


def markdown(data: dict) -> str:
    """The results page."""
    lines = ["SIGINT -> process exit of each node (`python -m ...`, as `ros2 run` starts "
             "it; bringup: all three in one process, standing in for `ros2 launch`), "
             f"{data['runs']} runs each, idle and with a camera at {CAMERA_HZ:g} frames/s.",
             "", "| node | load | runs | median ms | max ms | < 1 s | exit status |",
             "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['node']} | {r['load']} | {r['runs']} | {r['median_ms']:.0f} | "
                     f"{r['max_ms']:.0f} | {r['under_1s']}/{r['runs']} | "
                     f"{', '.join(map(str, r['exit_status']))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--nodes", nargs="+", default=list(NODES), choices=list(NODES))
    ap.add_argument("--no-save", action="store_true", help="print only")
    args = ap.parse_args(argv)
    rows = summary(measure(args.nodes, args.runs))
    for r in rows:
        print(f"{r['node']:16s} {r['load']:6s} median {r['median_ms']:6.0f} ms  max "
              f"{r['max_ms']:6.0f} ms  under 1 s {r['under_1s']}/{r['runs']}")
    if not args.no_save:
        print(harness.save("shutdown", {"runs": args.runs, "camera_hz": CAMERA_HZ,
                                        "rows": rows}, options=args))
    return 0 if all(r["under_1s"] == r["runs"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

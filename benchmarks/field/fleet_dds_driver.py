"""The benchmark's own ROS side for bench_fleet_dds.py: one publisher per camera, the
consumer of every camera's predictions and step times, the reader of the nodes' fleet
reports (tta_msgs/FleetReport: the sizes served, the forward per size) and of the
scheduler's fleet status on /diagnostics (the sizes chosen, the objective planned with),
and the scheduler's parameters.

Everything runs on one node in its own rclpy context (the nodes' ROS domain), spun by an
executor thread; frames are published from the caller's thread on an absolute schedule
(frame i of a camera at t0 + i / hz on time.monotonic, the clock the answers are timed
on), so a late publish never shifts the frames after it.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.srv import SetParameters
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import Image
from tta_msgs.msg import AdaptationStatus, ClassPrediction, FleetReport

from tta_core.elasticdnn.fleet import App
from tta_ros.nodes.fleet_wiring import FLEET_STATUS, REPORT_QOS, REPORT_TOPIC, app_from_report
from tta_ros.spinning import SpinThread

SCHEDULER = "/fleet_scheduler"


def image_msgs(images: Any) -> list[Image]:
    """One rgb8 Image per (H, W, 3) uint8 frame."""
    out = []
    for im in images:
        h, w, _ = im.shape
        out.append(Image(height=h, width=w, encoding="rgb8", step=3 * w,
                         data=im.astype("uint8").tobytes()))
    return out


class Driver:
    """Cameras + consumer + fleet report reader (module docstring); a context manager."""

    def __init__(self, domain_id: int, cams: Sequence[Any]) -> None:
        self.ctx = rclpy.context.Context()
        rclpy.init(context=self.ctx, domain_id=domain_id,
                   signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node("fleet_bench", context=self.ctx)
        self.msgs = {c.ns: (image_msgs(c.settle), image_msgs(c.window)) for c in cams}
        self.pubs = {c.ns: self.node.create_publisher(Image, f"{c.ns}/image",
                                                      qos_profile_sensor_data) for c in cams}
        rel = QoSProfile(depth=1000, reliability=ReliabilityPolicy.RELIABLE)
        for c in cams:
            self.node.create_subscription(ClassPrediction, f"{c.ns}/predictions",
                                          lambda m, ns=c.ns: self._on_pred(ns, m), rel)
            self.node.create_subscription(AdaptationStatus, f"{c.ns}/adaptation_status",
                                          lambda m, ns=c.ns: self._on_step(ns, m), rel)
            self.node.create_subscription(FleetReport, f"{c.ns}/{REPORT_TOPIC}",
                                          lambda m, ns=c.ns: self._on_report(ns, m),
                                          REPORT_QOS)
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, rel)
        self.client = self.node.create_client(SetParameters, f"{SCHEDULER}/set_parameters")
        self.recording: int | None = None  # the window whose sizes are being sampled
        # (ns, window) -> [(frame, receive time, label, node batch id)]
        self.answers: dict[tuple[str, int], list] = defaultdict(list)
        self.steps: dict[str, dict[int, float]] = defaultdict(dict)  # ns -> batch -> ms
        self.served: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.chosen: dict[tuple[str, int], list[float]] = defaultdict(list)
        self.objective: dict[int, list[str]] = defaultdict(list)  # window -> planned with
        # (ns, window) -> the node's predicted forward per size (largest first), per report
        self.forward: dict[tuple[str, int], list[list[float]]] = defaultdict(list)
        self.reports: dict[str, FleetReport] = {}  # latest fleet report per camera
        self.waiting = ""
        self.alive: Callable[[], None] = lambda: None  # raises when a node process died
        self.ex = SingleThreadedExecutor(context=self.ctx)
        self.ex.add_node(self.node)
        self.spin: SpinThread | None = None

    def __enter__(self) -> Driver:
        self.spin = SpinThread(self.ex)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.spin is not None:
            self.spin.stop()  # after the running callback: no callback on a destroyed node
        self.node.destroy_node()
        self.ctx.try_shutdown()

    # ------------------------------------------------------------ callbacks
    def _on_pred(self, ns: str, msg: ClassPrediction) -> None:
        t = time.monotonic()
        tag = msg.header.frame_id
        if tag.startswith("w"):
            window, _, i = tag[1:].partition(":")
            self.answers[ns, int(window)].append((int(i), t, int(msg.label),
                                                  int(msg.batch_id)))

    def _on_step(self, ns: str, msg: AdaptationStatus) -> None:
        self.steps[ns][int(msg.batch_id)] = float(msg.total_ms)

    def _on_report(self, ns: str, msg: FleetReport) -> None:
        self.reports[ns] = msg
        rec = self.recording
        if rec is not None and math.isfinite(msg.served):
            self.served[ns, rec].append(float(msg.served))
            self.forward[ns, rec].append([float(v) for v in msg.forward_ms])

    def _on_diag(self, msg: DiagnosticArray) -> None:
        rec = self.recording
        for st in msg.status:
            if rec is None or st.name != f"{SCHEDULER}: {FLEET_STATUS}":
                continue
            for kv in st.values:
                if kv.key.startswith("keep "):
                    self.chosen[kv.key[5:], rec].append(float(kv.value))
                elif kv.key == "objective":
                    self.objective[rec].append(kv.value)

    # ------------------------------------------------------------ actions
    def apps(self, cams: Sequence[Any], paper: bool = False) -> list[App] | None:
        """Every camera's App from its latest fleet report (`paper`: with T, A, Ã); None
        (and `waiting` says which) while one is missing or incomplete."""
        try:
            out = []
            for c in cams:
                msg = self.reports.get(c.ns)
                if msg is None:
                    raise ValueError(f"{c.ns}: no fleet report yet")
                out.append(app_from_report(c.ns, msg, paper))
            return out
        except ValueError as exc:
            self.waiting = str(exc)
            return None

    def set_scheduler(self, **params: object) -> None:
        """Set the scheduler's parameters (SetParameters), once its service is up (waits as
        long as the node processes live); RuntimeError when refused."""
        while not self.client.wait_for_service(timeout_sec=1.0):
            self.alive()  # raises when a node process exited: wait as long as they live
        req = SetParameters.Request(parameters=[Parameter(k, value=v).to_parameter_msg()
                                                for k, v in params.items()])
        fut = self.client.call_async(req)
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        while not done.wait(1.0):
            self.alive()  # the scheduler answers unless its process died
        res = fut.result()
        if res is None or not all(r.successful for r in res.results):
            why = [r.reason for r in res.results] if res is not None else "no answer"
            raise RuntimeError(f"scheduler refused {params}: {why}")

    def stream(self, cams: Sequence[Any], seconds: float, window: int | None
               ) -> tuple[float, list[float]]:
        """Publish every camera at its rate for `seconds`: the window's frames tagged
        `w<window>:<i>` (window None: the settle frames, cycled, untagged). Returns t0
        (frame 0's scheduled time) and the publishes' lateness in ms."""
        events = sorted((i / c.hz, k, i) for k, c in enumerate(cams)
                        for i in range(round(seconds * c.hz)))
        late: list[float] = []
        self.alive()
        t0 = time.monotonic() + 0.02
        check = t0 + 1.0
        for dt, k, i in events:
            cam = cams[k]
            wait = t0 + dt - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            else:
                late.append(-wait * 1e3)
            settle, frames = self.msgs[cam.ns]
            msg = frames[i] if window is not None else settle[i % len(settle)]
            msg.header.frame_id = f"w{window}:{i}" if window is not None else "s"
            self.pubs[cam.ns].publish(msg)
            if time.monotonic() > check:
                self.alive()
                check += 1.0
        return t0, late

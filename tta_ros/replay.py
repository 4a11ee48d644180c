"""Replay a bag through the perception pipeline over real ROS 2 and report accuracy/latency.

The bag's images are published on the perception node's image topic (original stamps
kept, so predictions join to ground truth by stamp); `predictions` and
`adaptation_status` are collected (and `layer_plan`, so the report names the layers each
batch's plan updated); the result is the same report as `tta bench`
(tta_core.eval.report) plus end-to-end latency image publish -> prediction received.

Pacing: `real` keeps the bag's relative timing, `<hz>` a fixed rate, `max` as fast as
the pipeline goes with flow control (at most `window` images awaiting a prediction, so the
perception queue never overflows) unless `allow_drops`. The nodes run in-process
(tta_ros.bringup.build_nodes, on an executor thread) or are already running (`external`).
Partial results are flushed every `flush_every` predictions; Ctrl-C writes what it has.

A segmentation bag (ground-truth masks: tta_core.io.bag) is scored from the masks the node
publishes on `segmentation` instead (joined by stamp; mIoU per domain:
tta_core.eval.seg_replay), reported in seg_report.json / .md.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile
from rclpy.signals import SignalHandlerOptions
from sensor_msgs.msg import Image
from tta_msgs.msg import AdaptationStatus, ClassPrediction, LayerPlan

from tta_core.eval.report import FrameRecord, RunRecord, report_dict, write_json_atomic
from tta_core.eval.report_files import ReportFiles, write_report
from tta_core.eval.seg_replay import SegReplayRun, SegReportFiles, score_run, write_seg_report
from tta_core.io.bag import BagFrame, read_bag, stamp_ns
from tta_ros.paths import package_file
from tta_ros.spinning import SpinThread

STATUS_PHASES = {"forward": "forward_ms", "plan": "plan_ms", "backward": "backward_ms",
                 "reforward": "reforward_ms", "total": "total_ms"}


@dataclass
class ReplayOptions:
    """What to replay and how; see the module docstring for pacing and flow control."""

    bag: Path
    config: Path = field(default_factory=lambda: package_file("config/vehicle.yaml"))
    rate: str = "max"  # "real" | "max" | a rate in Hz
    method: str | None = None
    out: Path | None = None  # None: no files written
    external: bool = False
    allow_drops: bool = False
    window: int = 0  # images awaiting a prediction in max mode; 0: the perception batch size
    flush_every: int = 50
    timeout_s: float = 20.0  # no prediction for this long -> the rest counts as dropped
    max_frames: int = 0  # 0: all
    image_topic: str = "image"
    predictions_topic: str = "predictions"
    segmentation_topic: str = "segmentation"  # a segmentation bag's answers
    status_topic: str = "adaptation_status"
    plan_topic: str = "layer_plan"
    overrides: dict[str, Any] = field(default_factory=dict)
    # leave out the config's method.* values the method has no option for (the demo
    # replays one config with several methods)
    own_options_only: bool = False

    def __post_init__(self) -> None:
        self.bag = Path(self.bag)
        parse_rate(self.rate)
        for name in ("window", "flush_every", "max_frames"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")


@dataclass
class ReplayResult:
    """The joined run (a segmentation bag's: scored masks), the files written and the
    message counts seen."""

    run: RunRecord | SegReplayRun
    files: ReportFiles | SegReportFiles | None
    n_published: int
    n_predictions: int
    n_statuses: int
    interrupted: bool


def parse_rate(rate: str) -> float | None:
    """None for "real", inf for "max", else a positive rate in Hz (ValueError otherwise)."""
    if rate == "real":
        return None
    if rate == "max":
        return math.inf
    try:
        hz = float(rate)
    except ValueError:
        hz = math.nan
    if not (hz > 0 and math.isfinite(hz)):
        raise ValueError(f"rate must be 'real', 'max' or a rate in Hz > 0, got {rate!r}")
    return hz


class Collector:
    """Thread-safe store of predictions (by stamp) and statuses (by batch id)."""

    def __init__(self, segmentation: bool = False) -> None:
        self.segmentation = segmentation  # answers are masks (no batch id): see settled
        self.cond = threading.Condition()
        self.predictions: dict[int, tuple[ClassPrediction, float]] = {}
        self.statuses: dict[int, AdaptationStatus] = {}
        self.plans: dict[int, tuple[str, ...]] = {}  # plan_id -> names of the units it updates
        self.published: dict[int, float] = {}  # stamp -> perf_counter at publish

    def on_prediction(self, msg: ClassPrediction) -> None:
        with self.cond:
            self.predictions[stamp_ns(msg.header)] = (msg, time.perf_counter())
            self.cond.notify_all()

    def on_mask(self, msg: Image) -> None:
        """A `segmentation` mask: kept as an array by stamp (its latency as a prediction's)."""
        mask = mask_array(msg)
        with self.cond:
            self.predictions[stamp_ns(msg.header)] = (mask, time.perf_counter())
            self.cond.notify_all()

    def on_status(self, msg: AdaptationStatus) -> None:
        with self.cond:
            self.statuses[int(msg.batch_id)] = msg
            self.cond.notify_all()

    def on_plan(self, msg: LayerPlan) -> None:
        with self.cond:
            self.plans[int(msg.plan_id)] = tuple(
                n for n, u in zip(msg.unit_names, msg.update, strict=False) if u)

    def in_flight(self) -> int:
        return sum(1 for s in self.published if s not in self.predictions)

    def settled(self) -> bool:
        """Every published frame predicted and every predicted batch's status received
        (perception publishes a batch's status right after its predictions)."""
        if self.segmentation:  # masks carry no batch id: every frame answered
            return self.in_flight() == 0
        return self.in_flight() == 0 and all(int(m.batch_id) in self.statuses
                                             for m, _ in self.predictions.values())

    def wait(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `done()` (checked under the lock) or no message for `timeout_s`."""
        with self.cond:
            while not done():
                seen = len(self.predictions) + len(self.statuses)

                def moved(seen: int = seen) -> bool:
                    return done() or len(self.predictions) + len(self.statuses) > seen

                if not self.cond.wait_for(moved, timeout_s):
                    return False
            return True


def mask_array(msg: Image) -> np.ndarray:
    """A mono8 / mono16 mask message as an (H, W) array (rows cut to their width)."""
    wide = msg.encoding == "mono16"
    data = np.frombuffer(bytes(msg.data), np.dtype("<u2") if wide else np.uint8)
    per_row = msg.step // (2 if wide else 1)
    return data[: msg.height * per_row].reshape(msg.height, per_row)[:, : msg.width]


def build_seg_run(frames: list[BagFrame], col: Collector, wall_s: float, method: str,
                  meta: dict[str, Any]) -> SegReplayRun:
    """Score the masks received against the bag's masks (by stamp), per domain."""
    with col.cond:
        masks = {t: (m, 1000.0 * (t_recv - col.published[t]))
                 for t, (m, t_recv) in col.predictions.items() if t in col.published}
        statuses, published = list(col.statuses.values()), dict(col.published)
    if statuses:
        method = statuses[0].method or method
    truth = [(f.stamp_ns, f.mask, f.domain) for f in frames]
    return score_run(method, truth, masks, statuses, published, wall_s=wall_s, meta=meta)


def image_msg(frame: BagFrame) -> Image:
    """sensor_msgs/Image (rgb8) of a bag frame with its original stamp."""
    msg = Image()
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(frame.stamp_ns, 1_000_000_000)
    msg.header.frame_id = "camera"
    msg.height, msg.width = frame.image.shape[:2]
    msg.encoding, msg.is_bigendian, msg.step = "rgb8", 0, frame.image.shape[1] * 3
    msg.data = np.ascontiguousarray(frame.image).tobytes()
    return msg


def build_run(frames: list[BagFrame], col: Collector, wall_s: float, method: str,
              meta: dict[str, Any]) -> RunRecord:
    """Join published frames with their predictions and batch statuses (by stamp/batch)."""
    with col.cond:
        preds, stats, plans = dict(col.predictions), dict(col.statuses), dict(col.plans)
        published = dict(col.published)
    records, dropped = [], 0
    for f in frames:
        if f.stamp_ns not in preds:
            dropped += f.stamp_ns in published
            continue
        p, t_recv = preds[f.stamp_ns]
        st = stats.get(int(p.batch_id))
        phases = {k: float(getattr(st, a)) for k, a in STATUS_PHASES.items()} if st else {}
        records.append(FrameRecord(f.domain, f.label, int(p.label), int(p.batch_id), phases,
                                   1000.0 * (t_recv - published[f.stamp_ns]), f.stamp_ns,
                                   float(p.confidence),
                                   float(st.budget_ms) if st else math.nan,
                                   bool(st.adapted) if st else None))
    peak = max((float(s.peak_memory_mb) for s in stats.values()), default=math.nan)
    if stats:
        method = next(iter(stats.values())).method or method
        meta = {**meta, "mode": next(iter(stats.values())).mode,
                "plan_ids": sorted({int(s.plan_id) for s in stats.values()})[:1000],
                "layer_updates": layer_updates(
                    [stats[b] for b in sorted({r.batch_id for r in records}) if b in stats],
                    plans)}
    return RunRecord(method, records, wall_s, peak, dropped, meta)


def layer_updates(statuses: list[AdaptationStatus],
                  plans: dict[int, tuple[str, ...]]) -> dict[str, Any]:
    """Which layers the batches updated and how often (report.json `meta.layer_updates`,
    tta_core.eval.report.layer_updates_markdown): per unit, the batches whose plan (a
    LayerPlan received, by plan_id) updated it; a batch planned inline (plan_id 0) or
    whose plan was not received counts in `unnamed` (its status gives only the count)."""
    units: dict[str, int] = {}
    adapted = unnamed = from_topic = 0
    for st in statuses:
        from_topic += int(st.plan_id) != 0
        if not st.adapted:
            continue
        adapted += 1
        names = plans.get(int(st.plan_id)) if int(st.plan_id) else None
        if names is None:
            unnamed += 1
            continue
        for n in names:
            units[n] = units.get(n, 0) + 1
    return {"batches": len(statuses), "adapted": adapted, "from_topic_plans": from_topic,
            "unnamed": unnamed, "units": units,
            "units_updated_mean": (sum(int(s.units_updated) for s in statuses)
                                   / len(statuses)) if statuses else math.nan}


class _Pacer:
    """When to publish each frame: bag timing, a fixed rate, or flow-controlled max."""

    def __init__(self, rate: str, window: int, allow_drops: bool) -> None:
        self.hz, self.window, self.allow_drops = parse_rate(rate), window, allow_drops
        self.t0 = time.perf_counter()
        self.stamp0: int | None = None

    def wait_turn(self, i: int, frame: BagFrame, col: Collector, timeout_s: float) -> None:
        if self.hz is None:  # real: the bag's relative timing
            self.stamp0 = frame.stamp_ns if self.stamp0 is None else self.stamp0
            due = self.t0 + (frame.stamp_ns - self.stamp0) / 1e9
        elif math.isfinite(self.hz):
            due = self.t0 + i / self.hz
        else:
            if not self.allow_drops:
                col.wait(lambda: col.in_flight() < self.window, timeout_s)
            return
        time.sleep(max(0.0, due - time.perf_counter()))


def replay_nodes(opts: ReplayOptions, context: Any = None) -> list[Node]:
    """The in-process nodes of a replay: `opts.config` with `opts.overrides`, perception's
    `method` (and only its options, with own_options_only); none when external."""
    if opts.external:
        return []
    from tta_ros.bringup import build_nodes

    overrides = {k: dict(v) for k, v in opts.overrides.items()}
    if opts.method:
        overrides.setdefault("perception", {})["method"] = opts.method
    topic = None if opts.image_topic == "image" else opts.image_topic
    return build_nodes(opts.config, overrides, context=context, image_topic=topic,
                       own_options_only=opts.own_options_only)


class _Session:
    """The ROS side of a replay: its own node, executor thread and (optionally) the nodes."""

    def __init__(self, opts: ReplayOptions, context: Any, segmentation: bool = False) -> None:
        self.context = context
        self.nodes: list[Node] = replay_nodes(opts, context)
        self.node = Node("tta_replay", context=context, start_parameter_services=False)
        self.col = Collector(segmentation)
        qos = QoSProfile(depth=1000)
        self.pub = self.node.create_publisher(Image, opts.image_topic, qos)
        self.answers = opts.segmentation_topic if segmentation else opts.predictions_topic
        if segmentation:
            self.node.create_subscription(Image, self.answers, self.col.on_mask, qos)
        else:
            self.node.create_subscription(ClassPrediction, self.answers,
                                          self.col.on_prediction, qos)
        self.node.create_subscription(AdaptationStatus, opts.status_topic,
                                      self.col.on_status, qos)
        self.node.create_subscription(LayerPlan, opts.plan_topic, self.col.on_plan, qos)
        self.executor = SingleThreadedExecutor(context=context)  # see tta_ros.bringup
        for n in (self.node, *self.nodes):  # predictions are taken before planning work
            self.executor.add_node(n)
        self.spin = SpinThread(self.executor, name="tta-replay")

    def _param(self, name: str, default: int) -> int:
        for n in self.nodes:
            if n.has_parameter(name):
                return int(n.get_parameter(name).value)
        return default

    def default_window(self) -> int:
        """Images in flight at max rate: one batch being processed + one filling the queue
        (external nodes: one batch of 4, within the sensor-data QoS history depth of 5)."""
        if not self.nodes:
            return 4
        batch = self._param("batch_size", 1)
        return batch + min(batch, max(1, self._param("queue_size", batch) - 1))

    def received(self) -> int | None:
        """Images the in-process perception node has taken in (None when external)."""
        queues = [n.queue for n in self.nodes if hasattr(n, "queue")]
        return sum(q.received for q in queues) if queues else None

    def wait_received(self, n: int, timeout_s: float = 0.5) -> None:
        """Wait until the in-process node took `n` images, so bursts never overflow the
        subscription's QoS history (external nodes: a short pause instead)."""
        end = time.monotonic() + timeout_s
        while (got := self.received()) is not None and got < n and time.monotonic() < end:
            time.sleep(0.0005)
        if got is None:
            time.sleep(0.002)

    def wait_connected(self, opts: ReplayOptions, timeout_s: float) -> None:
        """Wait until the image topic has a subscriber and predictions have a publisher."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if (self.pub.get_subscription_count() > 0
                    and self.node.count_publishers(self.answers) > 0):
                time.sleep(0.2)  # let discovery finish both ways
                return
            time.sleep(0.05)
        raise RuntimeError(
            f"no perception node subscribed to {opts.image_topic!r} / publishing "
            f"{self.answers!r} within {timeout_s:.0f} s"
            + (" (is it running? try without --external)" if opts.external else ""))

    def close(self) -> None:
        self.spin.stop()  # after the running callback: no callback on a destroyed node
        for n in (*self.nodes, self.node):
            n.destroy_node()


def _publish_all(sess: _Session, opts: ReplayOptions, frames: list[BagFrame],
                 pacer: _Pacer, flush: Callable[[], None],
                 progress: Callable[[int, int], None] | None) -> None:
    col, flushed = sess.col, 0
    for i, f in enumerate(frames):
        pacer.wait_turn(i, f, col, opts.timeout_s)
        msg = image_msg(f)
        with col.cond:
            col.published[f.stamp_ns] = time.perf_counter()
        sess.pub.publish(msg)
        if pacer.hz == math.inf and not opts.allow_drops:
            sess.wait_received(i + 1)
        if progress:
            progress(i + 1, len(frames))
        if opts.flush_every and len(col.predictions) // opts.flush_every > flushed:
            flushed = len(col.predictions) // opts.flush_every
            flush()
    col.wait(col.settled, opts.timeout_s)


def replay(opts: ReplayOptions, context: Any = None,
           progress: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Replay `opts.bag` through the nodes and return (and write, if `opts.out`) the report.

    `context`: an initialised rclpy Context (None: rclpy's default one, initialised here
    if needed). `progress(published, total)` is called after each image.
    """
    frames = list(read_bag(opts.bag))
    if opts.max_frames:
        frames = frames[: opts.max_frames]
    if not frames:
        raise ValueError(f"bag {opts.bag} has no images")
    segmentation = frames[0].mask is not None
    own_init = context is None and not rclpy.ok()
    if own_init:  # no rclpy signal handlers: Ctrl-C must not end the context before close()
        rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    try:
        sess = _Session(opts, context or rclpy.get_default_context(), segmentation)
    except BaseException:
        if own_init:
            rclpy.try_shutdown()
        raise
    meta = {"bag": str(opts.bag), "rate": opts.rate, "external": opts.external,
            "frames_in_bag": len(frames)}
    t0 = time.perf_counter()
    interrupted = False

    def snapshot() -> RunRecord | SegReplayRun:
        with sess.col.cond:  # the stream ends with its last prediction, not a timeout
            last = max((t for _, t in sess.col.predictions.values()), default=None)
        end = last if last is not None else time.perf_counter()
        build = build_seg_run if segmentation else build_run
        return build(frames, sess.col, end - t0, opts.method or "?", meta)

    def flush() -> None:
        if opts.out and not segmentation:  # a segmentation run is scored at the end
            write_json_atomic(Path(opts.out) / "partial.json",
                              report_dict([snapshot()], include_frames=True))

    try:
        sess.wait_connected(opts, timeout_s=15.0)
        window = opts.window or sess.default_window()
        pacer = _Pacer(opts.rate, window, opts.allow_drops)
        t0 = pacer.t0
        _publish_all(sess, opts, frames, pacer, flush, progress)
    except KeyboardInterrupt:
        interrupted = True
        sess.col.wait(lambda: sess.col.in_flight() == 0, 1.0)
    finally:
        run = snapshot()
        counts = (len(sess.col.published), len(sess.col.predictions), len(sess.col.statuses))
        sess.close()
        if own_init:
            rclpy.try_shutdown()
    run.meta["interrupted"] = interrupted
    files = _write(run, opts) if opts.out and run.frames else None
    return ReplayResult(run, files, *counts, interrupted)


def _write(run: RunRecord | SegReplayRun, opts: ReplayOptions
           ) -> ReportFiles | SegReportFiles:
    out = Path(opts.out)  # type: ignore[arg-type]
    if isinstance(run, SegReplayRun):
        return write_seg_report([run], out, title=f"tta replay {opts.bag.name}")
    files = write_report([run], out, title=f"tta replay {opts.bag.name}")
    (out / "partial.json").unlink(missing_ok=True)
    return files

"""Camera frame intake of the perception node: never faster than the worker can use frames.

Under overload the cost that starves the worker is not the image callback's body (it only
queues bytes) but the executor taking every message that arrives: at 10x the sustainable
rate that is thousands of Python callbacks a second competing with the worker for the GIL
(measured: the worker's per-batch Python work doubled, answered frames fell to 60-78 % of
saturation; benchmarks/field/bench_overload.py). So frames are taken on an executor of their own,
on a thread that takes only while fewer than `backlog` frames wait; beyond that the DDS
reader keeps the newest frames (keep-last, sensor-data QoS) and overwrites older ones in
C++, at no Python cost. Frames lost that way (or anywhere between the camera and us) are
counted from gaps in each publisher's sequence numbers, so frames_dropped stays complete.

Each frame taken is converted to the model's input (`prepare`: read, decode, reduce,
normalise) before it enters the queue, on a small pool of converter threads, so the worker
batches ready tensors and one costly frame (a 4K PNG) holds up neither the batch it would
have joined nor, with a second converter free, the frames that follow it (they may then
enter the queue before it). Frames being converted count towards the backlog, so the
intake still takes no more than the worker uses.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import QoSProfile
from sensor_msgs.msg import Image

from tta_ros.nodes.perception_support import FrameQueue


class SequenceGaps:
    """Messages missed per publisher, from its publication sequence numbers."""

    def __init__(self) -> None:
        self._last: dict[bytes, int] = {}

    def missed(self, publisher: bytes, seq: int | None) -> int:
        """How many of this publisher's messages were skipped before `seq` (0 when the
        number is unknown, the first seen, or not newer than the last one)."""
        if seq is None:
            return 0
        last = self._last.get(publisher)
        if last is not None and seq <= last:
            return 0  # reordered or repeated: nothing new was missed
        self._last[publisher] = seq
        return 0 if last is None else seq - last - 1


class FrameIntake:
    """Subscribes to `topic` on its own node + executor thread, converts each frame on a
    converter thread and feeds `queue`."""

    def __init__(self, owner: Node, queue: FrameQueue, topic: str, qos: QoSProfile,
                 backlog: Callable[[], int], msg_type: type = Image,
                 prepare: Callable[[bytes], Any] | None = None, converters: int = 2) -> None:
        """`topic`: the owner's resolved image topic (namespace and remaps applied);
        `backlog()`: how many queued or converting frames stop the intake (read every
        time); `msg_type`: the frames' message type (sensor_msgs Image or
        CompressedImage), taken serialized; `prepare(raw)`: what enters the queue for
        those bytes, None for a frame it refused (and counted); the bytes themselves
        without it; `converters`: threads converting frames at once."""
        if converters < 1:
            raise ValueError(f"converters must be >= 1, got {converters}")
        self.queue, self.backlog = queue, backlog
        self.prepare = prepare if prepare is not None else (lambda raw: raw)
        self.converters = converters
        self.gaps = SequenceGaps()
        self.taken = 0  # frames taken from the subscription (the converting ones included)
        self._busy = 0  # frames being converted
        self._idle = threading.Condition()
        self._pool = ThreadPoolExecutor(converters, thread_name_prefix="perception-convert")
        # No global ROS arguments: launch's `-r __node:=perception` would otherwise rename
        # this node too (two /perception in the graph); namespace and topic come resolved.
        self.node = rclpy.create_node(f"{owner.get_name()}_intake", context=owner.context,
                                      namespace=owner.get_namespace(),
                                      use_global_arguments=False,
                                      start_parameter_services=False)
        self.node.create_subscription(msg_type, topic, self._on_frame, qos, raw=True)
        self._executor = SingleThreadedExecutor(context=owner.context)
        self._executor.add_node(self.node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="perception-intake",
                                        daemon=True)
        self._thread.start()

    def _on_frame(self, raw: bytes, info: dict) -> None:
        gid = info.get("publisher_gid") or {}
        self.queue.count_lost(self.gaps.missed(bytes(gid.get("data", b"")),
                                               info.get("publication_sequence_number")))
        with self._idle:
            self._busy += 1
            self.taken += 1
        self._pool.submit(self._convert, raw, time.monotonic())

    def _convert(self, raw: bytes, arrived: float) -> None:
        """One frame prepared and queued (stamped with its arrival), or counted refused."""
        try:
            item = self.prepare(raw)
        except Exception as exc:  # prepare refuses bad frames itself: this is a bug
            self.node.get_logger().error(f"frame conversion failed: {type(exc).__name__}: "
                                         f"{exc}", throttle_duration_sec=1.0)
            item = None
        try:
            if item is None:
                self.queue.count_refused()
            else:
                self.queue.push(item, arrived)
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _free(self) -> bool:
        """Wait (briefly) for a free converter; True when one is."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy < self.converters, timeout=0.05)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._free() or not self.queue.wait_below(self.backlog() - self._busy,
                                                             timeout=0.05):
                continue  # the worker is behind: let DDS keep the newest frames
            try:
                self._executor.spin_once(timeout_sec=0.05)
            except Exception:  # context shut down under us: stop taking frames
                if not self.node.context.ok():
                    return
                raise

    def close(self) -> None:
        """Stop taking frames, finish the ones being converted, release the intake node
        (before the context goes)."""
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._pool.shutdown(wait=True)
        self._executor.shutdown(timeout_sec=1.0)
        self.node.destroy_node()

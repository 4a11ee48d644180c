"""ROS wiring of deadline budgets, shared by the scheduler and perception nodes.

The deadline arithmetic lives in tta_core (adashadow.deadline, reached through the planning
service); here: the scheduler's deadline parameters (the DeadlineConfig options under
the same names; the perception node has them as `method.<name>` options of its method,
tta_ros.nodes.method_params), where the speed comes from (ODOMETRY_PARAMS, both nodes),
the check of a parameter change against the other deadline settings (min <= max), and
`SpeedFeed`, the vehicle's planar speed from an odometry topic (nav_msgs/Odometry, or
geometry_msgs/TwistStamped), unknown (None) when the last message is older than its
timeout (scheduler: `odometry_timeout_s`, perception: `feed_timeout_s`), when none came
yet, or when the message package is not installed, and `BatchDeadline`, the perception
node's side of it: the deadline a batch is reported with (AdaptationStatus.deadline_ms),
what a deadline-aware method is told before it plans inline (the speed, the lateness of the
batch), and the speed its planning status shows.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy

from tta_core.adashadow.planning import DeadlineConfig
from tta_core.api import DeadlineTunable
from tta_core.runtime.deadline import batch_deadline_ms
from tta_core.runtime.options import describe
from tta_ros.ros_params import ParamSpec

#: odometry_type -> (module, message class, path of the linear velocity in the message)
SPEED_MSGS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "nav_msgs/Odometry": ("nav_msgs.msg", "Odometry", ("twist", "twist", "linear")),
    "geometry_msgs/TwistStamped": ("geometry_msgs.msg", "TwistStamped", ("twist", "linear")),
}
DEADLINE_KEYS = tuple(f.name for f in dataclasses.fields(DeadlineConfig))

ODOMETRY_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("odometry_topic", "odom", "speed deadline: odometry topic (relative: in the "
              "node's namespace)"),
    ParamSpec("odometry_type", "nav_msgs/Odometry", "message type on odometry_topic (planar "
              "speed of its linear velocity)", choices=tuple(SPEED_MSGS)),
)
# the scheduler's deadline parameters: the DeadlineConfig options under their own names
# (help and ranges from tta_core.runtime.options), where the speed comes from, its timeout
DEADLINE_PARAMS: tuple[ParamSpec, ...] = (
    *(ParamSpec(o.name, o.default, o.help, o.low, o.high, tuple(o.choices))
      for o in describe(DeadlineConfig)),
    *ODOMETRY_PARAMS,
    ParamSpec("odometry_timeout_s", 1.0, "older odometry counts as unknown speed "
              "(min_deadline_ms)", 0.01, 3600.0),
)


def deadline_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """The DeadlineConfig fields among a node's parameter values."""
    return {k: values[k] for k in DEADLINE_KEYS if k in values}


def check_deadline_change(current: Mapping[str, Any], changes: Iterable[Any]) -> str:
    """'' when the deadline settings stay consistent after `changes` (rclpy Parameters),
    else the reason naming the value (e.g. min_deadline_ms above max_deadline_ms)."""
    new = {**deadline_settings(current),
           **{p.name: p.value for p in changes if p.name in DEADLINE_KEYS}}
    try:
        DeadlineConfig(**new).validate()
    except ValueError as exc:
        return str(exc)
    return ""


def planar_speed(msg: Any, path: tuple[str, ...]) -> float:
    """|(vx, vy)| of the linear velocity at `path` in `msg` (NaN when not finite)."""
    v = msg
    for name in path:
        v = getattr(v, name)
    speed = math.hypot(float(v.x), float(v.y))
    return speed if math.isfinite(speed) else math.nan


def resolve_topic(node: Node, topic: str) -> str:
    """`topic` resolved by `node` (namespace, remaps), or a ValueError naming it."""
    try:
        return node.resolve_topic_name(topic)
    except Exception as exc:  # rclpy raises RCLError
        why = str(exc).splitlines()[0].removeprefix("failed to resolve name: ").split(", at ")[0]
        raise ValueError(f"odometry_topic {topic!r} is not a valid topic name: {why}") from None


class SpeedFeed:
    """The vehicle's latest planar speed from `topic`, for "speed" deadlines."""

    def __init__(self, node: Node, topic: str, type_name: str, timeout_s: float,
                 now: Callable[[], float]) -> None:
        self.node, self.timeout_s, self._now = node, float(timeout_s), now
        self._sub: Any = None
        self._latest: tuple[float, float] | None = None  # (time, speed)
        self.error = ""  # why no speed can come in ("" when subscribed)
        self.admit: Callable[[float], bool] = lambda _speed: True  # plausibility gate
        self.topic = ""
        self.subscribe(topic, type_name)

    def subscribe(self, topic: str, type_name: str) -> None:
        """(Re)subscribe to `topic` with message type `type_name` (SPEED_MSGS key);
        ValueError naming the topic when it is not a valid name (nothing changed then)."""
        self.topic = resolve_topic(self.node, topic)
        if self._sub is not None:
            self.node.destroy_subscription(self._sub)
            self._sub = None
        self._latest = None
        module, cls, path = SPEED_MSGS[type_name]
        try:
            msg_type = getattr(importlib.import_module(module), cls)
        except ImportError:
            self.error = (f"{type_name} is not installed ({module.split('.')[0]}): no speed "
                          f"from {self.topic}; odometry_type geometry_msgs/TwistStamped "
                          f"works without it")
            return
        self.error = ""
        qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT)  # any publisher
        self._sub = self.node.create_subscription(
            msg_type, topic, lambda msg: self.on_speed(planar_speed(msg, path)), qos)

    def on_params(self, new: Mapping[str, Any], timeout_key: str = "odometry_timeout_s",
                  ) -> None:
        """Apply accepted parameter changes: a new timeout (parameter `timeout_key`), or a
        new topic/type (resubscribe)."""
        if timeout_key in new:
            self.timeout_s = float(new[timeout_key])
        if "odometry_topic" in new or "odometry_type" in new:
            def value(name: str) -> Any:
                return new[name] if name in new else self.node.get_parameter(name).value
            self.subscribe(value("odometry_topic"), value("odometry_type"))

    def on_speed(self, speed_mps: float, now: float | None = None) -> None:
        """A speed reading (NaN, or one `admit` refuses, is ignored)."""
        if math.isfinite(speed_mps) and self.admit(speed_mps):
            self._latest = (self._now() if now is None else now, float(speed_mps))

    def speed(self, now: float | None = None) -> float | None:
        """The latest speed while fresh, else None (unknown)."""
        latest = self._latest
        now = self._now() if now is None else now
        if latest is None or now - latest[0] > self.timeout_s:
            return None
        return latest[1]

    def describe(self, now: float | None = None) -> str:
        """'' when the speed is known, else why not (for diagnostics)."""
        if self.error:
            return self.error
        if self.speed(now) is None:
            return (f"no odometry on {self.topic!r} within {self.timeout_s:g} s: speed "
                    f"unknown, the shortest deadline applies")
        return ""


class BatchDeadline:
    """The perception node's deadlines: the `speed` feed, and `late_ms()`, how long ago the
    newest frame of the batch being stepped arrived (FrameQueue.late_ms)."""

    def __init__(self, speed: SpeedFeed, late_ms: Callable[[], float]) -> None:
        self.speed, self.late_ms = speed, late_ms

    def batch_ms(self, method: object, batch_size: int) -> float:
        """AdaptationStatus.deadline_ms: the deadline of a batch of `batch_size` frames by
        the `method`'s deadline settings and the speed it was given (the whole deadline,
        before any lateness; a plan from layer_plan was made against the scheduler's, which
        follows these settings: its deadline_from); NaN in sigma*T mode or for a method
        without deadlines."""
        cfg = getattr(method, "config", None)
        if not isinstance(cfg, DeadlineConfig):
            return math.nan
        return batch_deadline_ms(cfg, batch_size, self.speed.speed())

    def brief(self, method: object) -> None:
        """Before an inline step: a deadline-aware method is told the speed and how late the
        batch starts (others are left alone)."""
        if isinstance(method, DeadlineTunable):
            method.set_speed(self.speed.speed())
            method.set_lateness(self.late_ms())

    def status_values(self, deadline_mode: str | None) -> dict[str, str]:
        """The speed for the planning status, or why it is unknown; only in speed mode
        (nothing otherwise: the odometry does not count)."""
        if deadline_mode != "speed":
            return {}
        speed = self.speed.speed()
        return {"speed": f"{speed:.4g} m/s" if speed is not None else self.speed.describe()}

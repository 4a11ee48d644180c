"""/diagnostics for the three nodes: one way to build a DiagnosticStatus and publish it.

Statuses are named "tta <node>: <subsystem>" (the aggregator groups by the prefix); values
are key/value strings with floats in 6 significant digits. Publishing is serialised by a
lock (the perception worker and the node's timer both publish)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.node import Node

OK, WARN, ERROR, STALE = (DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR,
                          DiagnosticStatus.STALE)


def key_values(values: Mapping[str, object]) -> list[KeyValue]:
    """KeyValue list; floats with 6 significant digits, everything else as str()."""
    return [KeyValue(key=k, value=f"{v:.6g}" if isinstance(v, float) else str(v))
            for k, v in values.items()]


def status(name: str, level: int, message: str,
           values: Mapping[str, object] | None = None) -> DiagnosticStatus:
    """One DiagnosticStatus with its values."""
    return DiagnosticStatus(level=level, name=name, message=message, hardware_id="",
                            values=key_values(values or {}))


class DiagnosticsPublisher:
    """Stamped DiagnosticArray publishing on /diagnostics, safe from several threads."""

    def __init__(self, node: Node, topic: str = "/diagnostics") -> None:
        self._node = node
        self._pub = node.create_publisher(DiagnosticArray, topic, 10)
        self._lock = threading.Lock()

    def publish(self, statuses: Sequence[DiagnosticStatus]) -> None:
        arr = DiagnosticArray(status=list(statuses))
        arr.header.stamp = self._node.get_clock().now().to_msg()
        with self._lock:
            self._pub.publish(arr)

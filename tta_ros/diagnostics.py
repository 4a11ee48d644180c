"""/diagnostics for the three nodes: one way to build a DiagnosticStatus and publish it.

Nodes build statuses named by their subsystem only ("input", "planning", "cpu", ...);
`DiagnosticsPublisher` names each one "<node's fully qualified name>: <subsystem>" (e.g.
"/car1/perception: input") and fills `hardware_id` from the node's `hardware_id` parameter
(`HARDWARE_ID`; empty or undeclared: the machine's hostname), so statuses of two vehicles
on one /diagnostics never collide. Values are key/value strings with floats in 6
significant digits. Publishing is serialised by a lock (the perception worker and the
node's timer both publish)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping, Sequence

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.node import Node

from tta_ros.ros_params import ParamSpec

OK, WARN, ERROR, STALE = (DiagnosticStatus.OK, DiagnosticStatus.WARN, DiagnosticStatus.ERROR,
                          DiagnosticStatus.STALE)

HARDWARE_ID = ParamSpec("hardware_id", socket.gethostname(), "DiagnosticStatus.hardware_id "
                        "of this node's /diagnostics (empty: the machine's hostname)",
                        read_only=True)


def key_values(values: Mapping[str, object]) -> list[KeyValue]:
    """KeyValue list; floats with 6 significant digits, everything else as str()."""
    return [KeyValue(key=k, value=f"{v:.6g}" if isinstance(v, float) else str(v))
            for k, v in values.items()]


def status(name: str, level: int, message: str,
           values: Mapping[str, object] | None = None) -> DiagnosticStatus:
    """One DiagnosticStatus of subsystem `name` with its values (the publisher qualifies
    the name and fills hardware_id)."""
    return DiagnosticStatus(level=level, name=name, message=message, hardware_id="",
                            values=key_values(values or {}))


def node_hardware_id(node: Node) -> str:
    """The node's `hardware_id` parameter, or the hostname when empty or undeclared."""
    value = node.get_parameter(HARDWARE_ID.name).value \
        if node.has_parameter(HARDWARE_ID.name) else ""
    return str(value or socket.gethostname())


class DiagnosticsPublisher:
    """Stamped DiagnosticArray publishing on /diagnostics, safe from several threads.

    Every status goes out named "<fully qualified node name>: <its name>" with the node's
    hardware_id (a status that already carries the prefix or a hardware_id keeps it)."""

    def __init__(self, node: Node, topic: str = "/diagnostics") -> None:
        self._node = node
        # a managed node's is a lifecycle publisher: it publishes only while active
        create = getattr(node, "create_lifecycle_publisher", node.create_publisher)
        self._pub = create(DiagnosticArray, topic, 10)
        self._lock = threading.Lock()
        self.prefix = f"{node.get_fully_qualified_name()}: "
        self.hardware_id = node_hardware_id(node)

    def qualified(self, st: DiagnosticStatus) -> DiagnosticStatus:
        """A copy of `st` with the node's name prefix and hardware_id."""
        name = st.name if st.name.startswith(self.prefix) else self.prefix + st.name
        return DiagnosticStatus(level=st.level, name=name, message=st.message,
                                hardware_id=st.hardware_id or self.hardware_id,
                                values=list(st.values))

    def publish(self, statuses: Sequence[DiagnosticStatus]) -> None:
        arr = DiagnosticArray(status=[self.qualified(s) for s in statuses])
        arr.header.stamp = self._node.get_clock().now().to_msg()
        with self._lock:
            self._pub.publish(arr)

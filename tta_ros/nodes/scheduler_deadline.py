"""One deadline: the scheduler's budget settings follow perception's.

With `deadline_from` set (default "perception"; relative: in the scheduler's namespace),
the scheduler's `sigma` and deadline parameters (deadline_mode, deadline_ms, deadline_per,
camera_hz, distance_per_decision_m, min/max_deadline_ms) mirror that node's
`method.<name>` options, the ones its method plans inline with and reports deadline_ms by:
read once through its GetParameters service as soon as it answers, then every value it
announces on /parameter_events (declared when it starts or switches method, set at run
time). So `ros2 param set /perception method.deadline_ms 50` reaches both nodes. The values
taken over go through the scheduler's own parameter check and are its parameters
(`ros2 param get /scheduler deadline_ms`); set the deadline on perception: one set on the
scheduler holds only until perception announces another. A method without deadline
options (tent) announces none, and the scheduler keeps its own. `deadline_from: ''`: the
scheduler's own parameters only (a scheduler without a perception node).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rcl_interfaces.msg import ParameterEvent, ParameterType
from rcl_interfaces.srv import GetParameters
from rclpy.node import Node
from rclpy.parameter import Parameter, parameter_value_to_python
from rclpy.qos import qos_profile_parameter_events

from tta_ros.nodes.deadline_wiring import DEADLINE_KEYS
from tta_ros.ros_params import ParamSpec

#: the scheduler parameters that follow the source node's `method.<name>`
FOLLOWED: tuple[str, ...] = ("sigma", *DEADLINE_KEYS)
PREFIX = "method."

DEADLINE_FROM = ParamSpec(
    "deadline_from", "perception", "node whose method.sigma and method.deadline_* options "
    "the scheduler's sigma and deadline parameters follow, at start and at run time "
    "(relative: in the scheduler's namespace; '': the scheduler's own)", read_only=True)


def source_name(node: Node, name: str) -> str:
    """The fully qualified name of the node `name` ('' stays ''): relative names are in
    `node`'s namespace."""
    if not name or name.startswith("/"):
        return name
    return f"{node.get_namespace().rstrip('/')}/{name}"


class DeadlineFollower:
    """Takes the source node's deadline options over into `node`'s parameters."""

    def __init__(self, node: Node, source: str) -> None:
        self.node, self.source = node, source_name(node, source)
        self.synced = False  # the source's values were read (GetParameters) or announced
        self.taken = 0  # values taken over
        self.refused = ""  # why the scheduler refused the last values taken over
        self._announced: set[str] = set()  # names announced on /parameter_events
        self._pending: Any = None
        if not self.source:
            return
        self._client = node.create_client(GetParameters, f"{self.source}/get_parameters")
        node.create_subscription(ParameterEvent, "/parameter_events", self._on_event,
                                 qos_profile_parameter_events)
        self._timer = node.create_timer(0.2, self._ask)

    def describe(self) -> str:
        """For diagnostics: where the deadline comes from."""
        if not self.source:
            return "own parameters"
        return f"{self.source} ({'followed' if self.synced else 'not heard from yet'})"

    def _ask(self) -> None:
        """Read the source's current values once, when its service answers: one request
        per name (GetParameters answers nothing at all when one name is undeclared)."""
        if self.synced or self._pending or not self._client.service_is_ready():
            return
        self._pending = {k: self._client.call_async(GetParameters.Request(names=[PREFIX + k]))
                         for k in FOLLOWED}
        for future in self._pending.values():
            future.add_done_callback(self._on_value)

    def _on_value(self, _future: Any) -> None:
        """Once every request is answered: take the values the source has."""
        if not self._pending or not all(f.done() for f in self._pending.values()):
            return
        answers = {k: f.result() for k, f in self._pending.items() if f.exception() is None}
        self._pending = None
        self.synced = True
        self._timer.cancel()
        self.take({k: parameter_value_to_python(r.values[0]) for k, r in answers.items()
                   if r is not None and r.values and k not in self._announced
                   and r.values[0].type != ParameterType.PARAMETER_NOT_SET})

    def _on_event(self, event: ParameterEvent) -> None:
        if event.node != self.source:
            return
        values = {p.name.removeprefix(PREFIX): parameter_value_to_python(p.value)
                  for p in (*event.new_parameters, *event.changed_parameters)
                  if p.name.removeprefix(PREFIX) in FOLLOWED and p.name.startswith(PREFIX)}
        self._announced.update(values)  # newer than an answer still on its way
        if values:
            self.synced = True
            self.take(values)

    def take(self, values: Mapping[str, Any]) -> None:
        """Set the values that differ as the node's parameters, at once (its own check
        applies; a refusal is logged and kept in `refused`)."""
        changes = [Parameter(k, value=v) for k, v in values.items()
                   if self.node.get_parameter(k).value != v]
        if not changes:
            return
        res = self.node.set_parameters_atomically(changes)
        if res.successful:
            self.taken += len(changes)
            self.refused = ""
        else:
            self.refused = f"deadline from {self.source} refused: {res.reason}"
            self.node.get_logger().warning(self.refused)
